"""What quantising the output head's inputs too (as llama.cpp does, and as `--activations q8`
does since the head's Q8_0 panels, quant_q8_0.h) costs and buys: perplexity, greedy agreement and
decode-step time of the q8 model with its head multiplying int8 inputs against the same model with
a float head (what q8 did before); not a test.

    python scripts/q8_head.py [MODEL] [ROUNDS]

MODEL: a GGUF or "default". Perplexity over 2,000 tokens of metaloom's docs, greedy agreement over
`metaloom.bench.activations.PROMPTS` x 64 tokens, one-token steps of 1 and 16 rows forked from a
256-token prompt (both heads and both widths in turn each round, medians of ROUNDS (default 3)
after a warm-up round), and each head's 16-row step over its one-row step.
"""

from __future__ import annotations

import statistics
import sys

import torch

from metaloom.bench.activations import PROMPTS, greedy, step_seconds
from metaloom.bench.kv import held_out_ids, perplexity
from metaloom.models.engine.llama import LlamaModel
from metaloom.models.engine.native import with_activations
from metaloom.models.kernels.isa import chosen, cpu_name
from metaloom.models.kernels.quant import QuantWeight
from metaloom.models.load import load
from metaloom.prefix.radix import common_prefix


def main() -> None:
    torch.set_num_threads(2)
    loaded = load(sys.argv[1] if len(sys.argv) > 1 else "default", weights="native")
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    q8_head = with_activations(loaded.model, "q8")
    head = loaded.model.lm_head
    assert isinstance(q8_head, LlamaModel) and isinstance(head, QuantWeight), "a native GGUF's quantised head"
    q8 = LlamaModel(q8_head.config, loaded.model.embed, q8_head.layers, q8_head.norm, head, q8_head.fused,
                    q8_head.options)
    models = {"float": loaded.model, "q8": q8, "q8, head too": q8_head}
    print(f"{cpu_name()}, {chosen().name} path; head {q8_head.lm_head}")
    tok = loaded.tokenizer
    ids = held_out_ids(tok)[:2001]
    for name, m in models.items():
        print(f"{name}: perplexity {perplexity(m, ids, 256):.4f}", flush=True)
    for ref in ("float", "q8"):
        agree = []
        for text in PROMPTS:
            p = tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]), add_special_tokens=False)
            a, b = greedy(models[ref], p, 64), greedy(q8_head, p, 64)
            agree.append((common_prefix(a, b), a == b))
        print(f"head too against {ref}: {sum(same for _, same in agree)} of {len(agree)} identical, "
              f"mean shared prefix {statistics.mean(n for n, _ in agree):.1f} tokens", flush=True)
    # the width target's ratio (a 16-row step over a one-row step), each round timing both widths of
    # both heads in turn, so that the host's drift falls on both sides of each ratio
    per: dict[tuple[str, int], list[float]] = {(n, r): [] for n in ("q8", "q8, head too") for r in (1, 16)}
    for i in range(rounds + 1):
        for name, rows in per:
            seconds = step_seconds(models[name], rows, 256, 10, shared=True)
            if i:  # the first round warms up
                per[(name, rows)].append(seconds)
    for name in ("q8", "q8, head too"):
        one, wide = statistics.median(per[(name, 1)]), statistics.median(per[(name, 16)])
        ratios = sorted(w / o for o, w in zip(per[(name, 1)], per[(name, 16)], strict=True))
        print(f"{name}: 1 row {one * 1e3:.2f} ms, 16 rows {wide * 1e3:.2f} ms (medians of {rounds}): "
              f"{wide / one:.2f}x; per round {ratios[0]:.2f}-{ratios[-1]:.2f}x, median {statistics.median(ratios):.2f}x",
              flush=True)


if __name__ == "__main__":
    main()

"""What quantising the output head's inputs too (as llama.cpp does, and as `--activations q8`
does since the head's Q8_0 panels, quant_q8_0.h) costs and buys: perplexity, greedy agreement and
decode-step time of the q8 model with its head multiplying int8 inputs against the same model with
a float head (what q8 did before); not a test.

    python scripts/q8_head.py [MODEL]

MODEL: a GGUF or "default". Perplexity over 2,000 tokens of metaloom's docs, greedy agreement over
`metaloom.bench.activations.PROMPTS` x 64 tokens, one-token steps of 1 and 16 rows forked from a
256-token prompt (the two heads alternating, median of 3 rounds after a warm-up).
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
    for rows in (1, 16):
        per: dict[str, list[float]] = {"q8": [], "q8, head too": []}
        for _ in range(4):
            for name in per:
                per[name].append(step_seconds(models[name], rows, 256, 10, shared=True))
        print(f"{rows} rows: " + ", ".join(f"{n} {statistics.median(v[1:]) * 1e3:.2f} ms" for n, v in per.items()),
              flush=True)


if __name__ == "__main__":
    main()

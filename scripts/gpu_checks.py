"""Device checks for the GPU engine (issue 35), run on a CUDA machine before the benchmark:

1. exactness in float32: greedy and seeded samples through `LocalGenerator` with the captured
   static step (METALOOM_CUDA_GRAPHS=on) against the eager step (off), token for token;
2. capture fidelity in bfloat16: a replayed graph against the same static step uncaptured, bit
   for bit, and greedy agreement of on/off in bfloat16 (different kernels: reported, not required);
3. where a batch-1 step's time goes: a bare forward loop, `LocalGenerator` greedy and seeded,
   eager and captured, and the host's busiest calls in the eager generate (torch.profiler).

Random-weight models built on the device as `metaloom bench gpu` builds them (`random_generator`),
the default model's tokenizer from ``--tokenizer``. Prints a table; ``--out FILE`` writes the figures as JSON.
usage: python scripts/gpu_checks.py --tokenizer .gpu/tokenizer --out $OUT/checks.json
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

import torch

from metaloom.bench import gpu_worker as gw
from metaloom.generator.local import LocalGenerator
from metaloom.generator.types import Request, TokenIds
from metaloom.ledger import Ledger
from metaloom.models.engine.graphs import StepGraphs
from metaloom.models.engine.llama import LlamaModel
from metaloom.models.engine.tokenizer import HFTokenizer
from metaloom.sampling import SamplingParams

PROMPT = "Explain in detail how a bicycle works, part by part."
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU: a dry run of the script's plumbing


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def random_generator(shape: str, vocab: int, dtype: str, folder: str) -> LocalGenerator:
    """A `LocalGenerator` on a random-weight model of ``shape`` (`metaloom.bench.gpu_worker`'s
    shapes and weights, as `metaloom bench gpu` builds them; the tiny shape on the CPU)."""
    cfg = gw.hf_config(shape if DEVICE == "cuda" else "tiny", vocab)
    hf = gw.build_transformers(cfg, DEVICE, dtype, seed=0)
    return gw.metaloom_generator(hf, cfg, folder, DEVICE, dtype, f"random {shape}")


def run(gen: LocalGenerator, mode: str, requests: list[Request]) -> tuple[list[list[tuple[int, ...]]], float]:
    os.environ["METALOOM_CUDA_GRAPHS"] = mode
    sync()
    start = time.perf_counter()
    out = gen.generate(requests, ledger=Ledger())
    sync()
    return [[c.token_ids for c in o] for o in out], time.perf_counter() - start


def first_difference(a: list[tuple[int, ...]], b: list[tuple[int, ...]]) -> int | None:
    for x, y in zip(a, b, strict=True):
        for i, (u, v) in enumerate(zip(x, y, strict=False)):
            if u != v:
                return i
        if len(x) != len(y):
            return min(len(x), len(y))
    return None


def exactness(tok: HFTokenizer, folder: str, ids: list[int]) -> dict[str, Any]:
    """Float32 (135m shape): on and off give the same tokens."""
    gen = random_generator("135m", tok.vocab_size, "float32", folder)
    model = gen.model
    greedy = [Request(TokenIds(tuple(ids)), SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))]
    seeded = [Request(TokenIds(tuple(ids)), SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=32,
                                                           ignore_eos=True)),
              Request(TokenIds(tuple(ids[:9])), SamplingParams(n=3, temperature=0.8, top_p=0.9, seed=2,
                                                               max_tokens=24, ignore_eos=True))]
    out: dict[str, Any] = {}
    for name, requests in (("greedy", greedy), ("seeded", seeded)):
        off, _ = run(gen, "off", requests)
        on, _ = run(gen, "on", requests)
        out[f"float32_{name}_equal"] = off == on
        out[f"float32_{name}_first_difference"] = first_difference([t for o in off for t in o], [t for o in on for t in o])
    stats = model.step_graph_stats()
    out["float32_captures"], out["float32_replays"] = stats["captures"], stats["replays"]
    out["capture_failure"] = "; ".join(stats["failures"]) or None  # type: ignore[arg-type]  # a list of reasons
    del gen, model
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    return out


def fidelity(model: LlamaModel, ids: list[int], steps: int = 24) -> dict[str, Any]:
    """A replayed graph against the same step uncaptured, from one prefill, bfloat16."""
    pool = model.new_pool(slots=4096)
    cache = model.new_cache(4, 512, pool)
    prompt = torch.tensor([ids] * 4, device=DEVICE)
    logits = model.forward(prompt, cache)[:, -1]
    other = cache.fork([0, 1, 2, 3])
    captured, plain = StepGraphs(model, pool, capture=DEVICE == "cuda"), StepGraphs(model, pool, capture=False)
    nxt = logits.argmax(-1)
    worst, equal = 0.0, True
    for _ in range(steps):
        a = captured.run(nxt[:, None], cache, [1] * 4)[0][:, -1]
        b = plain.run(nxt[:, None], other, [1] * 4)[0][:, -1]
        equal &= bool(torch.equal(a, b))
        worst = max(worst, float((a.float() - b.float()).abs().max()))
        nxt = a.argmax(-1)
    cache.release()
    other.release()
    return {"bf16_graph_vs_uncaptured_bitwise": equal, "bf16_graph_vs_uncaptured_max_abs": worst,
            "captures": captured.captures, "replays": captured.replays}


def step_times(gen: LocalGenerator, model: LlamaModel, ids: list[int], tokens: int = 128) -> dict[str, Any]:
    """Milliseconds per batch-1 step: a bare forward loop, and generate (greedy, seeded)."""
    out: dict[str, Any] = {}
    for mode in ("off", "on"):
        os.environ["METALOOM_CUDA_GRAPHS"] = mode
        for _ in range(2):  # the second is timed (the first captures)
            pool = model.new_pool(slots=1024)
            cache = model.new_cache(1, len(ids) + tokens + 1, pool)
            nxt = model.forward(torch.tensor([ids], device=DEVICE), cache)[:, -1].argmax(-1)
            sync()
            start = time.perf_counter()
            for _ in range(tokens):
                nxt = model.forward(nxt[:, None], cache)[:, -1].argmax(-1)
            sync()
            bare = (time.perf_counter() - start) / tokens * 1e3
            cache.release()
        out[f"bare_forward_ms_{mode}"] = bare
        for name, params in (("greedy", SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)),
                             ("seeded", SamplingParams(temperature=1.0, seed=1, max_tokens=tokens, ignore_eos=True))):
            request = [Request(TokenIds(tuple(ids)), params)]
            run(gen, mode, request)
            _, seconds = run(gen, mode, request)
            out[f"generate_{name}_ms_{mode}"] = seconds / tokens * 1e3
    return out


def host_profile(gen: LocalGenerator, ids: list[int], mode: str, tokens: int = 32) -> list[dict[str, Any]]:
    """The host's busiest calls in one batch-1 seeded generate (self CPU time per step)."""
    from torch.profiler import ProfilerActivity, profile

    request = [Request(TokenIds(tuple(ids)), SamplingParams(temperature=1.0, seed=3, max_tokens=tokens,
                                                            ignore_eos=True))]
    run(gen, mode, request)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run(gen, mode, request)
    rows = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:12]
    return [{"op": e.key, "calls_per_step": e.count / tokens, "self_cpu_ms_per_step": e.self_cpu_time_total / 1e3 / tokens,
             "device_ms_per_step": getattr(e, "self_device_time_total", 0) / 1e3 / tokens} for e in rows]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokenizer", required=True)
    p.add_argument("--out")
    args = p.parse_args()
    tok = HFTokenizer(args.tokenizer)
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": PROMPT}]), add_special_tokens=False)
    name = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (dry run, tiny shapes)"
    report: dict[str, Any] = {"device": name, "torch": torch.__version__}
    report.update(exactness(tok, args.tokenizer, ids))
    print({k: v for k, v in report.items()}, flush=True)
    gen = random_generator("1b", tok.vocab_size, "bfloat16", args.tokenizer)
    model = gen.model
    report.update(fidelity(model, ids))
    greedy = [Request(TokenIds(tuple(ids)), SamplingParams(temperature=0, max_tokens=128, ignore_eos=True))]
    off, _ = run(gen, "off", greedy)
    on, _ = run(gen, "on", greedy)
    report["bf16_1b_greedy_first_difference"] = first_difference(off[0], on[0])
    report.update(step_times(gen, model, ids))
    print({k: v for k, v in report.items()}, flush=True)
    report["host_profile_off"] = host_profile(gen, ids, "off")
    report["host_profile_on"] = host_profile(gen, ids, "on")
    for mode in ("off", "on"):
        print(f"-- busiest host calls per batch-1 seeded step, graphs {mode}")
        for r in report[f"host_profile_{mode}"]:
            print(f"  {r['op'][:48]:48s} {r['calls_per_step']:6.1f} calls {r['self_cpu_ms_per_step']:8.3f} ms host "
                  f"{r['device_ms_per_step']:8.3f} ms device")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    print("checks:", json.dumps({k: v for k, v in report.items() if not k.startswith("host_profile")}), flush=True)


if __name__ == "__main__":
    main()

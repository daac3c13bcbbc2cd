"""Where a many-row decode step's time goes on the GPU (issue 35): for R seeded samples on the
1b random-weight shape, (1) the captured forward alone, R rows a step, against (2) `LocalGenerator`
generating the same R samples, per step, and (3) torch.profiler's busiest ops in that generate
by device time and by host time, with the GPU's busy share of the wall time.

usage: python scripts/gpu_profile_rows.py --tokenizer .gpu/tokenizer --rows 64 --out $OUT/profile.json
(on a CPU: a dry run of the plumbing on the tiny shape)
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

import torch
from gpu_checks import DEVICE, random_generator, run, sync

from metaloom.generator.types import Request, TokenIds
from metaloom.models.engine.tokenizer import HFTokenizer
from metaloom.sampling import SamplingParams

PROMPT = "Write a long story about a lighthouse keeper who finds a message in a bottle."


def forward_ms(model: Any, ids: list[int], rows: int, tokens: int) -> float:
    """Milliseconds per captured step of ``rows`` one-token rows, forks of one prefilled prompt."""
    pool = model.new_pool(slots=rows * (len(ids) + 2 * tokens + 8))
    cache = model.new_cache(1, len(ids) + 2 * tokens + 4, pool)
    model.forward(torch.tensor([ids], device=DEVICE), cache)
    fork = cache.fork([0] * rows)
    nxt = torch.zeros((rows, 1), dtype=torch.long, device=DEVICE)
    for _ in range(3):
        nxt = model.forward(nxt, fork)[:, -1].argmax(-1)[:, None]
    sync()
    start = time.perf_counter()
    for _ in range(tokens):
        nxt = model.forward(nxt, fork)[:, -1].argmax(-1)[:, None]
    sync()
    return (time.perf_counter() - start) / tokens * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokenizer", required=True)
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--out")
    a = p.parse_args()
    os.environ["METALOOM_CUDA_GRAPHS"] = "on"
    tok = HFTokenizer(a.tokenizer)
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": PROMPT}]), add_special_tokens=False)
    gen = random_generator("1b", tok.vocab_size, "bfloat16", a.tokenizer)
    report: dict[str, Any] = {"device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu", "rows": a.rows}
    report["forward_ms_per_step"] = forward_ms(gen.model, ids, a.rows, a.tokens)
    req = [Request(TokenIds(tuple(ids)), SamplingParams(temperature=1.0, seed=5, n=a.rows, max_tokens=a.tokens,
                                                        ignore_eos=True))]
    run(gen, "on", req)
    _, seconds = run(gen, "on", req)
    report["generate_ms_per_step"] = seconds / a.tokens * 1e3
    print(report, flush=True)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        _, seconds = run(gen, "on", req)
    events = prof.key_averages()
    device_total = sum(getattr(e, "self_device_time_total", 0) for e in events) / 1e3
    report["profiled_ms_per_step"] = seconds / a.tokens * 1e3
    report["device_busy_ms_per_step"] = device_total / a.tokens
    for key, name in (("self_device_time_total", "by_device"), ("self_cpu_time_total", "by_host")):
        top = sorted(events, key=lambda e: -getattr(e, key, 0))[:15]
        report[name] = [{"op": e.key[:80], "calls_per_step": e.count / a.tokens,
                         "device_ms_per_step": getattr(e, "self_device_time_total", 0) / 1e3 / a.tokens,
                         "host_ms_per_step": e.self_cpu_time_total / 1e3 / a.tokens} for e in top]
    for name in ("by_device", "by_host"):
        print(f"-- busiest ops {name}")
        for r in report[name]:
            print(f"  {r['op'][:60]:60s} {r['calls_per_step']:7.1f} calls {r['device_ms_per_step']:8.3f} ms device "
                  f"{r['host_ms_per_step']:8.3f} ms host")
    print({k: v for k, v in report.items() if not k.startswith("by_")}, flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()

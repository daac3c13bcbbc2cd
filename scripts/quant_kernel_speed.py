"""Microbenchmark of the quantised matmul kernels (metaloom/models/kernels/quant.c); not a test.

    python scripts/quant_kernel_speed.py [--types Q4_1,Q8_0] [--reps 15] [--no-rows]

Prints markdown tables:

1. batch 1 (one row of x), per GGUF type on the weight shapes of SmolLM2-135M and Qwen2.5-0.5B:
   GB/s of blocks read at 1 and 2 threads in GGUF's layout and in quant.c's panels (float32 x;
   and bfloat16 x and y at 2 threads, in the layout a model runs), next to
   the machine's copy bandwidth (`metaloom.bench.timing.copy_bandwidth_gbs`, which counts read +
   write) and to torch.mv over the same shape dense in float32 (against float32 x) and bfloat16
   (against bfloat16 x);
2. an estimate of one decode token's matmuls for both models as their GGUFs store them (weights
   cached, as they are not when a model streams them from memory);
3. rows 1..128 of x: the kernel against dequantise + F.linear (where `CROSSOVER_ROWS` comes from).

Times are medians of repeated runs after a warm-up. On a machine shared with other work they are
noisy: the load average is printed; compare ratios taken in the same run.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from metaloom.bench.timing import copy_bandwidth_gbs
from metaloom.models.kernels.quant import QuantWeight
from metaloom.models.kernels.quant_library import kernels
from metaloom.models.kernels.quant_types import BY_NAME, QTYPES

SHAPES = {  # (model, weight): [out, in]
    ("SmolLM2-135M", "qkv"): (960, 576),
    ("SmolLM2-135M", "o"): (576, 576),
    ("SmolLM2-135M", "gate_up"): (3072, 576),
    ("SmolLM2-135M", "down"): (576, 1536),
    ("SmolLM2-135M", "head"): (49152, 576),
    ("Qwen2.5-0.5B", "qkv"): (1152, 896),
    ("Qwen2.5-0.5B", "o"): (896, 896),
    ("Qwen2.5-0.5B", "gate_up"): (9728, 896),
    ("Qwen2.5-0.5B", "down"): (896, 4864),
    ("Qwen2.5-0.5B", "head"): (151936, 896),
    ("Gemma-3-270M", "head"): (262144, 640),
}
# how the GGUFs store them: (weight, type, count per token)
TOKEN = {
    "SmolLM2-135M": [("qkv", "Q4_1", 30), ("o", "Q4_1", 30), ("gate_up", "Q4_1", 30), ("down", "Q4_1", 30),
                     ("head", "Q8_0", 1)],
    "Qwen2.5-0.5B": [("qkv", "Q5_0", 24), ("o", "Q5_0", 24), ("gate_up", "Q5_0", 24), ("down", "Q6_K", 12),
                     ("down", "Q4_K", 12), ("head", "Q8_0", 1)],
}
ROWS = (1, 2, 4, 8, 16, 32, 64, 96, 128, 192, 256)


def random_blocks(qtype: int, out: int, inputs: int, g: torch.Generator) -> torch.Tensor:
    """Random quants with moderate float16 scales (timing does not depend on the values)."""
    q = QTYPES[qtype]
    if q.name in ("F16", "BF16"):
        return torch.randn(out, inputs, generator=g).to(torch.float16 if q.name == "F16" else torch.bfloat16).view(
            torch.uint8)
    raw = torch.randint(0, 256, (out, inputs // q.block, q.bytes), dtype=torch.uint8, generator=g)
    scale = torch.tensor([0.01], dtype=torch.float16).view(torch.uint8)
    fields = {"Q4_1": (0, 2), "Q4_K": (0, 2), "Q6_K": (208,)}.get(q.name, (0,))
    for at in fields:
        raw[:, :, at:at + 2] = scale
    return raw.reshape(out, -1)


def dequantise_linear(w: QuantWeight, x: torch.Tensor) -> torch.Tensor:
    """What `QuantWeight.__call__` does above `CROSSOVER_ROWS`."""
    return F.linear(x, w.dequantize(x.dtype))


def median_seconds(fn: Callable[[], object], reps: int) -> float:
    fn()
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def batch_one(types: list[str], reps: int) -> dict[tuple[str, str, str], float]:
    """Table 1; returns the 2-thread seconds per (model, weight, type)."""
    k = kernels().kernels
    assert k is not None
    g = torch.Generator().manual_seed(0)
    seconds = {}
    print("| model | weight | [out, in] | type | MB | GB/s 1 thr | GB/s 2 thr | panels GB/s 1 thr | panels GB/s 2 thr |"
          " GB/s 2 thr bf16 x | us 2 thr | mv f32 us | mv bf16 us | x mv f32 | x mv bf16 |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for (model, name), (out, inputs) in SHAPES.items():
        x = torch.randn(1, inputs, generator=g)
        y = torch.empty(1, out)
        torch.set_num_threads(2)
        dense = torch.randn(out, inputs, generator=g)
        mv32 = median_seconds(functools.partial(torch.mv, dense, x[0]), reps)
        mv16 = median_seconds(functools.partial(torch.mv, dense.bfloat16(), x[0].bfloat16()), reps)
        del dense
        for t in types:
            qtype = BY_NAME[t]
            if inputs % QTYPES[qtype].kernel_block:
                continue
            w = QuantWeight(qtype, random_blocks(qtype, out, inputs, g), inputs)
            per = [median_seconds(functools.partial(k.matmul, qtype, w.blocks, inputs, x, y, 1, th), reps)
                   for th in (1, 2)]
            p = w.panelled()  # the layout a model runs (quant.c's panels where this build has them)
            run = k.panel_matmul if p.layout == "panel" else k.matmul
            panels = [median_seconds(functools.partial(k.panel_matmul, qtype, p.blocks, inputs, x, y, 1, th), reps)
                      for th in (1, 2)] if p.layout == "panel" else None
            bf16 = median_seconds(functools.partial(run, qtype, p.blocks, inputs, x.bfloat16(), y.bfloat16(), 1, 2), reps)
            best = panels[1] if panels else per[1]
            seconds[(model, name, t)] = best
            gbs = [w.nbytes / p / 1e9 for p in (*per, bf16)]
            pan = [f"{w.nbytes / p / 1e9:.1f}" for p in panels] if panels else ["-", "-"]
            print(f"| {model} | {name} | [{out}, {inputs}] | {t} | {w.nbytes / 1e6:.2f} | {gbs[0]:.1f} | {gbs[1]:.1f} | "
                  f"{pan[0]} | {pan[1]} | {gbs[2]:.1f} | {best * 1e6:.0f} | {mv32 * 1e6:.0f} | {mv16 * 1e6:.0f} | "
                  f"{mv32 / best:.1f} | {mv16 / bf16:.1f} |")
    return seconds


def per_token(seconds: dict[tuple[str, str, str], float]) -> None:
    print("\n| model | matmuls of one decode token (2 threads) |")
    print("|---|---|")
    for model, parts in TOKEN.items():
        if all((model, name, t) in seconds for name, t, _ in parts):
            total = sum(seconds[(model, name, t)] * n for name, t, n in parts)
            print(f"| {model} | {total * 1e3:.1f} ms |")


def rows_table(types: list[str], reps: int) -> None:
    """Table 3: kernel vs dequantise + F.linear, 2 threads, float32 x."""
    k = kernels().kernels
    assert k is not None
    g = torch.Generator().manual_seed(1)
    torch.set_num_threads(2)
    print("\n| weight | type | " + " | ".join(f"{r} rows" for r in ROWS) + " | crossover |")
    print("|---|---|" + "---|" * (len(ROWS) + 1))
    for model, name in (("SmolLM2-135M", "gate_up"), ("Qwen2.5-0.5B", "gate_up"), ("Qwen2.5-0.5B", "down")):
        out, inputs = SHAPES[(model, name)]
        for t in types:
            qtype = BY_NAME[t]
            if inputs % QTYPES[qtype].kernel_block:
                continue
            w = QuantWeight(qtype, random_blocks(qtype, out, inputs, g), inputs)
            cells, crossover = [], None
            for r in ROWS:
                x = torch.randn(r, inputs, generator=g)
                y = torch.empty(r, out)
                kern = median_seconds(functools.partial(k.matmul, qtype, w.blocks, inputs, x, y, r, 2), reps)
                dense = median_seconds(functools.partial(dequantise_linear, w, x), max(3, reps // 3))
                cells.append(f"{kern * 1e3:.2f} / {dense * 1e3:.2f}")
                if crossover is None and dense < kern:  # the first row count where F.linear wins
                    crossover = r
            print(f"| {model} {name} [{out}, {inputs}] | {t} | " + " | ".join(cells) + f" | {crossover or f'>{ROWS[-1]}'} |")
    print("\n(ms: kernel / dequantise + F.linear)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--types", default=",".join(q.name for q in QTYPES.values()))
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--no-rows", action="store_true", help="skip the rows-vs-F.linear table")
    args = parser.parse_args()
    types = [t for t in ["Q4_0", "Q4_1", "Q5_0", "Q8_0", "Q4_K", "Q6_K", "F16", "BF16"] if t in args.types.split(",")]
    available = kernels()
    if available.kernels is None:
        raise SystemExit(f"no kernels: {available.reason}")
    load = os.getloadavg()
    torch.set_num_threads(1)
    copy1 = copy_bandwidth_gbs(256)
    torch.set_num_threads(2)
    copy2 = copy_bandwidth_gbs(256)
    print(f"load average {load[0]:.2f} {load[1]:.2f}; torch {torch.__version__}; {os.cpu_count()} CPUs")
    print(f"copy bandwidth (read + write): {copy1:.1f} GB/s at 1 thread, {copy2:.1f} GB/s at 2 threads\n")
    seconds = batch_one(types, args.reps)
    per_token(seconds)
    if not args.no_rows:
        rows_table([t for t in types if t in ("Q4_1", "Q5_0", "Q8_0", "Q6_K", "Q4_K", "BF16")], args.reps)


if __name__ == "__main__":
    main()

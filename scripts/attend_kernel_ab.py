"""Decode attention (fused.c's `rope_attend_ex`, the per-row kernel) of a git revision against the
working tree's, both built for the path this CPU runs and loaded in one process, called
alternately; not a test.

    python scripts/attend_kernel_ab.py [--base HEAD] [--threads 2] [--rows 1,4,16] [--positions 256,1024]

Prints a markdown table: per model shape, pool type and rows x positions, median µs old / new
and the ratio, and whether the two outputs have the same bits. Each row attends its own keys
(a batch of separate prompts, or a verify with shared-prefix attention off). Both libraries are
compiled here with the same flags, so only the source differs; on a shared machine compare
ratios, not absolute times.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from metaloom.models.kernels import isa
from metaloom.models.kernels.fused import FusedKernels, _bind

sys.path.insert(0, str(Path(__file__).parent))
from kernel_sources import at_revision, compile_and_load, in_tree

FILES = ("fused.c", "vec_store.h")
# (label, query heads, kv heads, head dim)
SHAPES = (("SmolLM2 (9 / 3 heads)", 9, 3, 64), ("Qwen2.5-0.5B (14 / 2 heads)", 14, 2, 64),
          ("Qwen2.5-1.5B (12 / 2 heads, dim 128)", 12, 2, 128))


def build(sources: dict[str, str], where: Path) -> FusedKernels:
    lib, out = compile_and_load(sources, "fused.c", where)
    return _bind(lib, out, isa.chosen().name)


def case(h: int, hk: int, dim: int, rows: int, positions: int, int8: bool, forked: bool, contiguous: bool,
         g: torch.Generator) -> tuple[dict[str, torch.Tensor], int]:
    """Random inputs for one call: every row at `positions` cached keys, in slots of its own, or
    (``forked``) in the same slots as every other row (rows forked from one prompt) but its new one;
    a row's slots in order (``contiguous``, as a fresh cache lays a prompt out) or shuffled."""
    width = positions + 1
    slots = rows * width
    order = torch.arange(slots) if contiguous else torch.randperm(slots, generator=g)
    table = order.reshape(rows, width).contiguous()
    if forked:
        table[1:, :positions] = table[0, :positions]
    inputs = {
        "qkv": torch.randn(rows, (h + 2 * hk) * dim, generator=g),
        "cos": torch.rand(width, dim, generator=g), "sin": torch.rand(width, dim, generator=g),
        "lengths": torch.full((rows,), positions, dtype=torch.int64),
        "table": table,
    }
    if int8:
        inputs["keys"] = torch.randint(-127, 128, (slots, hk, dim), generator=g, dtype=torch.int8)
        inputs["values"] = torch.randint(-127, 128, (slots, hk, dim), generator=g, dtype=torch.int8)
        inputs["key_scales"] = torch.rand(slots, hk, generator=g) * 0.02
        inputs["value_scales"] = torch.rand(slots, hk, generator=g) * 0.02
    else:
        inputs["keys"] = torch.randn(slots, hk, dim, generator=g)
        inputs["values"] = torch.randn(slots, hk, dim, generator=g)
    return inputs, h


def call(k: FusedKernels, x: dict[str, torch.Tensor], h: int, out: torch.Tensor, threads: int) -> float:
    scales = (x["key_scales"], x["value_scales"]) if "key_scales" in x else None
    start = time.perf_counter()
    k.rope_attend(x["qkv"], x["cos"], x["sin"], x["lengths"], x["table"], x["keys"], x["values"], out, h, None,
                  threads, None, scales)
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--base", default="HEAD")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rows", default="1,4,16")
    p.add_argument("--positions", default="256,1024")
    p.add_argument("--calls", type=int, default=40)
    p.add_argument("--forked", action="store_true", help="rows share their cached keys' slots")
    p.add_argument("--contiguous", action="store_true", help="each row's slots in order (else shuffled)")
    args = p.parse_args()
    old, new = at_revision(FILES, args.base), in_tree(FILES)
    tmp = Path(tempfile.mkdtemp())
    libs = {"old": build(old, tmp / "old"), "new": build(new, tmp / "new")}
    g = torch.Generator().manual_seed(0)
    cells_of = [(r, n) for n in (int(v) for v in args.positions.split(",")) for r in (int(v) for v in args.rows.split(","))]
    print(f"{isa.cpu_name()}, {isa.chosen().name} path, {args.threads} threads, {args.base} -> working tree"
          f"{', rows forked from one prompt' if args.forked else ''}"
          f"{', slots in order' if args.contiguous else ', slots shuffled'}")
    print("| shape, pool | " + " | ".join(f"{r} x {n}" for r, n in cells_of) + " |")
    print("|---|" + "---|" * len(cells_of))
    for label, h, hk, dim in SHAPES:
        for int8 in (False, True):
            cells = []
            for rows, positions in cells_of:
                x, heads = case(h, hk, dim, rows, positions, int8, args.forked, args.contiguous, g)
                outs = {n: torch.empty(rows, h * dim) for n in libs}
                times: dict[str, list[float]] = {n: [] for n in libs}
                for turn in range(args.calls + 1):
                    for n, k in libs.items():
                        t = call(k, x, heads, outs[n], args.threads)
                        if turn:
                            times[n].append(t)
                same = torch.equal(outs["old"], outs["new"])
                a, b = (statistics.median(times[n]) * 1e6 for n in ("old", "new"))
                cells.append(f"{a:.0f} / {b:.0f} ({a / b:.2f}x){'' if same else ' DIFFERENT BITS'}")
            print(f"| {label}, {'int8' if int8 else 'float32'} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()

"""The q8 panel product (quant_q8.h's `quant_panel_matmul_q8`) of a git revision against the
working tree's, both built for the path this CPU runs and loaded in one process, called
alternately; not a test.

    python scripts/q8_kernel_ab.py [--base HEAD] [--threads 2] [--rows 1,4,16,32] [--calls 30] [--shapes TEXT]
        [--from-memory]

Prints a markdown table: per weight shape and row count, median µs old / new and the ratio, and
whether the two outputs have the same bits (NaN equal to NaN). Both libraries are compiled here
with the same flags (`metaloom.models.kernels.cbuild.compile_library`), so only the source
differs. On a shared machine compare ratios, not absolute times.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from kernel_sources import at_revision, compile_and_load, in_tree
from quant_kernel_speed import random_blocks

from metaloom.models.kernels import isa
from metaloom.models.kernels.quant import QuantWeight
from metaloom.models.kernels.quant_library import PARTS
from metaloom.models.kernels.quant_types import BY_NAME

FILES = ("quant.c", "quant_q8.h", "quant_q8_0.h", "vec_store.h")
SHAPES = (("SmolLM2 gate_up", "Q4_1", 3072, 576), ("SmolLM2 down", "Q4_1", 576, 1536),
          ("Qwen2.5-0.5B gate_up", "Q5_0", 9728, 896), ("Qwen2.5-0.5B down", "Q6_K", 896, 4864),
          ("a K-quant", "Q4_K", 2048, 1536), ("SmolLM2 head", "Q8_0", 49152, 576),
          ("Qwen2.5-1.5B gate_up", "Q4_K", 17920, 1536), ("Qwen2.5-1.5B head", "Q6_K", 151936, 1536))


def build(sources: dict[str, str], where: Path) -> ctypes.CDLL:
    lib, _ = compile_and_load(sources, "quant.c", where, parts=PARTS)
    lib.quant_panel_matmul_q8.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                          ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int,
                                          ctypes.c_int64, ctypes.c_int64]
    return lib


def alternate(libs: dict[str, ctypes.CDLL], qtype: int, w: QuantWeight, x: torch.Tensor, ys: dict[str, torch.Tensor],
              threads: int, calls: int, junk: torch.Tensor | None = None) -> dict[str, list[float]]:
    """Seconds of each call, the libraries taking turns (after one call each to warm up); with
    ``junk``, each call after a pass over it, so that the weight comes from memory as in a decode
    step (the other layers' weights have pushed it out of the caches)."""
    out, inputs = w.shape
    rows = x.shape[0]
    times: dict[str, list[float]] = {n: [] for n in libs}
    for turn in range(calls + 1):
        for n, lib in libs.items():
            if junk is not None:
                junk.add_(1.0)
            start = time.perf_counter()
            lib.quant_panel_matmul_q8(qtype, w.blocks.data_ptr(), out, inputs, x.data_ptr(), 0, ys[n].data_ptr(), 0,
                                      rows, threads)
            if turn:
                times[n].append(time.perf_counter() - start)
    return times


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--base", default="HEAD")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rows", default="1,4,16,32")
    p.add_argument("--calls", type=int, default=30)
    p.add_argument("--shapes", default="", help="only the shapes whose label holds this text")
    p.add_argument("--from-memory", action="store_true",
                   help="a 256 MB pass before each call: the weight comes from memory, not the caches")
    args = p.parse_args()
    rows_list = [int(r) for r in args.rows.split(",")]
    old, new = at_revision(FILES, args.base), in_tree(FILES)
    tmp = Path(tempfile.mkdtemp())
    libs = {"old": build(old, tmp / "old"), "new": build(new, tmp / "new")}
    g = torch.Generator().manual_seed(0)
    junk = torch.zeros(64 << 20) if args.from_memory else None
    print(f"{isa.cpu_name()}, {isa.chosen().name} path, {args.threads} threads, {args.base} -> working tree")
    print("| weight [out, in], type | " + " | ".join(f"{r} rows" for r in rows_list) + " |")
    print("|---|" + "---|" * len(rows_list))
    for label, t, out, inputs in (s for s in SHAPES if args.shapes in s[0]):
        qtype = BY_NAME[t]
        w = QuantWeight(qtype, random_blocks(qtype, out, inputs, g), inputs)
        w = (w.with_activations("q8") if t == "Q8_0" else w).panelled()  # Q8_0: panels of its own (quant_q8_0.h)
        cells = []
        for rows in rows_list:
            x = torch.randn(rows, inputs, generator=g)
            ys = {n: torch.empty(rows, out) for n in libs}
            times = alternate(libs, qtype, w, x, ys, args.threads, args.calls, junk)
            same = torch.equal(ys["old"].nan_to_num(7.0), ys["new"].nan_to_num(7.0))
            a, b = (statistics.median(times[n]) * 1e6 for n in ("old", "new"))
            cells.append(f"{a:.0f} / {b:.0f} ({a / b:.2f}x){'' if same else ' DIFFERENT BITS'}")
        print(f"| {label} [{out}, {inputs}], {t} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()

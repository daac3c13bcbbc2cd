"""Whole forwards with fused.c of a git revision against the working tree's: one model's weights
stepped through each build's fused kernels (`LlamaModel.with_fused`), in one process, alternating,
each on a cache of its own. A forward of W tokens (one row: W = 1 a decode step, W > 1 a chain
verify's shape) after P random prompt tokens, rolled back after each. Not a test.

    python scripts/attend_step_ab.py [--base HEAD] [--model default] [--activations q8]
                                     [--positions 1000,2000,4000] [--widths 1,4] [--rounds 20]

Prints median ms old / new per (P, W). Both builds compile here with the same flags, so only the
source differs; on a shared machine compare ratios, not absolute times.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from metaloom.models import load
from metaloom.models.kernels import isa

sys.path.insert(0, str(Path(__file__).parent))
from attend_kernel_ab import FILES, build  # the kernel-level A/B's sources and build
from kernel_sources import at_revision, in_tree


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--base", default="HEAD")
    p.add_argument("--model", default="default")
    p.add_argument("--activations", default="q8")
    p.add_argument("--positions", default="1000,2000,4000")
    p.add_argument("--widths", default="1,4")
    p.add_argument("--rounds", type=int, default=20)
    args = p.parse_args()
    base = load(args.model, weights="native", activations=args.activations).model
    with tempfile.TemporaryDirectory() as tmp:
        models = {"old": base.with_fused(build(at_revision(FILES, args.base), Path(tmp) / "old")),
                  "new": base.with_fused(build(in_tree(FILES), Path(tmp) / "new"))}
        print(f"{isa.cpu_name()}, {isa.chosen().name} path, {torch.get_num_threads()} threads, {args.model}, "
              f"{args.activations} activations, {args.base} -> working tree; median ms old / new")
        widths = [int(w) for w in args.widths.split(",")]
        with torch.no_grad():
            for n in (int(x) for x in args.positions.split(",")):
                caches, starts = {}, {}
                for side, m in models.items():
                    caches[side] = m.new_cache(1, n + max(widths) + 1)
                    m.forward(torch.randint(100, 40000, (1, n), generator=torch.Generator().manual_seed(0)),
                              caches[side], last_only=True)
                    starts[side] = torch.as_tensor(caches[side].host_lengths().copy())
                times: dict[tuple[str, int], list[float]] = {(s, w): [] for s in models for w in widths}
                for r in range(args.rounds):
                    for w in widths:
                        tokens = torch.randint(100, 40000, (1, w), generator=torch.Generator().manual_seed(w))
                        for side in ("old", "new") if r % 2 == 0 else ("new", "old"):
                            t0 = time.perf_counter()
                            models[side].forward(tokens, caches[side], last_only=False)
                            times[side, w].append(time.perf_counter() - t0)
                            caches[side].truncate(starts[side])
                cells = []
                for w in widths:
                    old, new = (statistics.median(times[s, w][2:]) * 1e3 for s in ("old", "new"))
                    cells.append(f"W={w}: {old:.2f} / {new:.2f} ({old / new:.2f}x)")
                print(f"P={n:5d}  " + "  ".join(cells), flush=True)
                for c in caches.values():
                    c.release()


if __name__ == "__main__":
    main()

"""The output head's products alone: a random 49,152 x 576 Q8_0 weight (SmolLM2's head) times
1, 4 and 16 rows, with float inputs (GGUF's layout, what a float head runs), int8 inputs in GGUF's
layout (quant_q8.h) and int8 inputs in quant_q8_0.h's panels (what `--activations q8` runs);
not a test.

    python scripts/q8_0_panels.py [OUT IN]

Each call follows a pass over 256 MB, so the weight comes from memory as in a decode step, where
the layers' weights have pushed it out of cache. The three alternate; medians of 12 calls.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from metaloom.models.kernels import quant
from metaloom.models.kernels.isa import chosen, cpu_name


def main() -> None:
    torch.set_num_threads(2)
    out, inputs = (int(sys.argv[1]), int(sys.argv[2])) if len(sys.argv) > 2 else (49152, 576)
    w = quant.quantize(torch.randn(out, inputs, generator=torch.Generator().manual_seed(0)), "Q8_0")
    weights = {"float": w, "q8, GGUF layout": w.with_activations("q8"), "q8, panels": w.with_activations("q8").panelled()}
    junk = torch.zeros(64 << 20)
    print(f"{cpu_name()}, {chosen().name} path; {out} x {inputs} Q8_0")
    for rows in (1, 4, 16):
        x = torch.randn(rows, inputs)
        times: dict[str, list[float]] = {name: [] for name in weights}
        for _ in range(12):
            for name, weight in weights.items():
                junk += 1  # the weight out of cache
                start = time.perf_counter()
                weight(x)
                times[name].append(time.perf_counter() - start)
        print(f"{rows} rows: " + ", ".join(f"{n} {statistics.median(t) * 1e3:.2f} ms" for n, t in times.items()))


if __name__ == "__main__":
    main()

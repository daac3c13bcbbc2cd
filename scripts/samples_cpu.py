"""Many samples on the CPU, this tree against an older copy of metaloom (issue 35: the batched
counter-based draw also cuts the per-step cost on the CPU at many rows).

usage: python scripts/samples_cpu.py --baseline DIR [--n 64] [--tokens 32] [--rounds 3]
  DIR holds an older `metaloom` package (e.g. `git archive c73a4ef metaloom | tar -x -C DIR`).
Each side runs in its own process, alternating, after a warm-up call: the default model, n
seeded samples of ``tokens`` tokens from a 354-token prompt (end of sequence ignored). Prints
each round and the medians.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

ONE = r"""
import json, os, sys, time
from metaloom.models import load
from metaloom.generator import LocalGenerator
from metaloom.generator.types import Request, TokenIds
from metaloom.ledger import Ledger
from metaloom.sampling import SamplingParams
n, tokens = int(sys.argv[1]), int(sys.argv[2])
lm = load("default")
g = LocalGenerator(lm, prefill_overhead_tokens=32)
text = "Read the following notes and then write a short story that uses all of them.\n" + "\n".join(
    f"Note {i}: the lighthouse keeper counted {i * 7} ships passing the northern rocks before dawn, "
    "and each one carried a different flag." for i in range(1, 13))
req = [Request(TokenIds(tuple(lm.tokenizer.encode(text))),
               SamplingParams(n=n, temperature=1.0, seed=1, max_tokens=tokens, ignore_eos=True))]
g.generate(req, ledger=Ledger())
t = time.perf_counter()
out = g.generate(req, ledger=Ledger())
made = sum(len(c.token_ids) for c in out[0])
print(json.dumps({"tok_s": made / (time.perf_counter() - t), "tokens": made, "weights": lm.weights}))
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--baseline", required=True)
    p.add_argument("--n", type=int, default=64)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    runs: dict[str, list[float]] = {"this tree": [], "baseline": []}
    for _ in range(args.rounds):
        for side, path in (("this tree", here), ("baseline", os.path.abspath(args.baseline))):
            env = {**os.environ, "PYTHONPATH": path, "HF_HUB_OFFLINE": "1"}
            out = subprocess.run([sys.executable, "-c", ONE, str(args.n), str(args.tokens)], env=env,
                                 capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
            runs[side].append(json.loads(out)["tok_s"])
            print(side, f"{runs[side][-1]:.1f} tok/s", flush=True)
    a, b = statistics.median(runs["this tree"]), statistics.median(runs["baseline"])
    print(f"{args.n} x {args.tokens}: this tree {a:.1f} tok/s, baseline {b:.1f} tok/s (x{a / b:.2f}), "
          f"medians of {args.rounds} alternating rounds")


if __name__ == "__main__":
    main()

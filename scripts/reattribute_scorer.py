"""Re-split a model scorer's FLOPs over the candidates of records written before 980dfd6.

Until then `metaloom eval` put an LLM judge's whole cost into a pooled record's ``shared``
usage, so a best-of-N-with-judge curve charged the judge's 32 questions to every N, N = 1
included. Since then `metaloom.eval.pool.attribute` splits the scorer's FLOPs over the
candidates by tokens. This rewrites the old records of one pooled strategy the way the runner
now writes them, through the same `attribute`:

    .venv/bin/python scripts/reattribute_scorer.py runs/gsm "best_of_n@n=32,scorer=judge" \
        --prefill-from majority_vote@n=32

The old records kept no trace events, so the scorer's FLOPs are recovered as the record's
``shared`` FLOPs less its pool's prefill, and the prefill is read from a scorer-free pooled
strategy of the same sweep on the same problem (``--prefill-from``: the same prompt, prefilled
the same way, costs the same FLOPs by the model's formula). Each candidate's own decode FLOPs are
kept as recorded. Records already split (``shared`` equal to the prefill) are left as they are.
Usage totals, answers, grades and scores do not change.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
from collections.abc import Sequence

from metaloom.eval.pool import attribute
from metaloom.eval.records import Record, read_records
from metaloom.generator.types import Completion
from metaloom.ledger import COUNTED, Usage
from metaloom.meta.types import Event, Result


def reattribute(record: Record, prefill: float) -> Record:
    """``record`` with its scorer's FLOPs (``shared`` less ``prefill``) split over its candidates."""
    scorer = float(record.shared["flops"] or 0.0) - prefill
    if scorer <= 1e-9 * max(1.0, prefill):
        return record  # nothing to split (or already split)
    own = {c.tokens: c.flops for c in record.candidates}  # the formula's FLOPs depend on the length alone
    cands = tuple(Completion(c.text, (0,) * c.tokens, (), "stop") for c in record.candidates)
    usage = Usage(**{k: v for k, v in record.usage.items() if k in COUNTED})
    sample_flops = math.fsum(float(c.flops or 0.0) for c in record.candidates) + prefill
    trace = (Event("sample", {"usage": {"input_tokens": usage.input_tokens, "flops": sample_flops}}),
             Event("score", {"usage": {"flops": scorer}}))
    costs, shared = attribute(Result(best=record.best, candidates=cands, usage=usage, trace=trace),
                              lambda _prompt, tokens: float(own[tokens] or 0.0))
    candidates = tuple(dataclasses.replace(c, flops=f, seconds=s)
                       for c, (f, s) in zip(record.candidates, costs, strict=True))
    return dataclasses.replace(record, candidates=candidates, shared=shared)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("dir")
    p.add_argument("strategy", help="the pooled strategy whose records to re-split (its spec as recorded)")
    p.add_argument("--prefill-from", required=True, metavar="SPEC",
                   help="a pooled strategy without a model scorer, at the same N, in the same sweep")
    args = p.parse_args(argv)
    path = os.path.join(args.dir, "records.jsonl")
    records = list(read_records(path))
    prefill = {r.problem: float(r.shared["flops"] or 0.0) for r in records if r.strategy == args.prefill_from}
    changed = 0
    out = []
    for r in records:
        if r.strategy == args.strategy and r.candidates:
            if r.problem not in prefill:
                raise SystemExit(f"{r.problem}: no {args.prefill_from} record to read the prefill from")
            new = reattribute(r, prefill[r.problem])
            changed += new is not r
            r = new
        out.append(json.dumps(r.to_dict()))
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write("\n".join(out) + "\n")
    os.replace(tmp, path)
    print(f"{changed} record(s) of {args.strategy} re-split")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

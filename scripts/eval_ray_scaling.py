"""How `metaloom eval`'s Ray fan-out scales: the same small sweep on the real default model with
1 worker (all the machine's CPUs as torch threads) and with 2 workers (half the threads each),
each on a fresh output directory, on one local Ray cluster started once (so its start-up is
not in either figure).

Reports per run the wall seconds (actors started, models loaded, every job run), the
seconds to the first record (mostly the model load) and the ratio 1-worker / 2-workers, and
checks that the two runs' greedy records agree on their answers (threads change the order of
float sums, so a rare tie may flip a greedy token: disagreements are reported, not fatal).

    .venv/bin/python scripts/eval_ray_scaling.py --limit 4 --max-tokens 48
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from metaloom.eval.ray_executor import make_ray_executor
from metaloom.eval.records import Record
from metaloom.eval.runner import plan_sweep, run_sweep
from metaloom.eval.worker import Job, Outcome, Setup


@dataclass(frozen=True)
class Run:
    workers: int
    threads: int
    wall: float
    first: float
    records: tuple[Record, ...]


def one_run(setup: Setup, specs: Sequence[str], out: str, workers: int, threads: int) -> Run:
    """The sweep with ``workers`` workers of ``threads`` torch threads each, timed."""
    from dataclasses import replace

    sweep = plan_sweep(replace(setup, threads=threads), specs, out)
    executor = make_ray_executor(workers=workers)
    firsts: list[float] = []
    start = time.perf_counter()

    def timed(s: Setup, jobs: Sequence[Job], emit: Callable[[Outcome], None]) -> None:
        def emit_timed(outcome: Outcome) -> None:
            firsts.append(time.perf_counter() - start)
            emit(outcome)

        executor(s, jobs, emit_timed)

    records = run_sweep(sweep, executor=timed)
    wall = time.perf_counter() - start
    return Run(workers, threads, wall, firsts[0] if firsts else wall, tuple(records))


def greedy_answers(run: Run) -> dict[str, str | None]:
    return {r.problem: r.answer for r in run.records if r.strategy == "greedy"}


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--task", default="arithmetic")
    p.add_argument("--limit", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--specs", nargs="+", default=["greedy", "majority_vote@n=2"])
    p.add_argument("--model", default="default")
    p.add_argument("--cpus", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    args = p.parse_args(argv)

    import ray

    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the workers inherit it: the default model is installed
    ray.init(num_cpus=args.cpus, include_dashboard=False, log_to_driver=False, logging_level=logging.ERROR)
    setup = Setup(task=args.task, limit=args.limit, model=args.model, max_tokens=args.max_tokens)
    runs = []
    try:
        for workers in (1, 2):
            with tempfile.TemporaryDirectory(prefix=f"ray-scaling-{workers}w-") as out:
                runs.append(one_run(setup, args.specs, out, workers, max(1, args.cpus // workers)))
    finally:
        ray.shutdown()
    one, two = runs
    a, b = greedy_answers(one), greedy_answers(two)
    agree = sum(a[k] == b.get(k) for k in a)
    result = {
        "task": args.task, "limit": args.limit, "specs": args.specs, "max_tokens": args.max_tokens, "cpus": args.cpus,
        "runs": [{"workers": r.workers, "threads": r.threads, "wall_s": round(r.wall, 2),
                  "first_record_s": round(r.first, 2), "records": len(r.records),
                  "correct": sum(x.correct for x in r.records)} for r in runs],
        "ratio_1w_over_2w": round(one.wall / two.wall, 3),
        "greedy_agree": f"{agree}/{len(a)}",
    }
    if args.json:
        print(json.dumps(result))
        return
    for r in result["runs"]:
        print(f"{r['workers']} worker(s) x {r['threads']} thread(s): {r['wall_s']:.2f} s wall "
              f"(first record at {r['first_record_s']:.2f} s), {r['records']} records, {r['correct']} correct")
    print(f"ratio (1 worker / 2 workers): {result['ratio_1w_over_2w']:.3f}x; greedy answers agree: {agree}/{len(a)}")


if __name__ == "__main__":
    main()

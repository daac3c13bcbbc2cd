"""`metaloom eval --task T --strategies SPEC... --out DIR`: run every (problem, strategy) pair,
one JSON Lines record each as it finishes (`metaloom.eval`); rerun with the same ``--out`` to
continue where it stopped. ``--select`` prints the compute-optimal choice as a strategy spec
that ``metaloom run --strategy`` and the server's model aliases accept; ``metaloom report DIR``
draws the curves."""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any

from metaloom.commands.common import add_model_args, engine_options, refuse_local_only
from metaloom.errors import InvalidParameter


def register(sub: argparse._SubParsersAction) -> None:
    e = sub.add_parser("eval", help="accuracy against compute: run strategies over a task's problems (resumable)")
    e.add_argument("--task", required=True,
                   help="countdown | game24 | arithmetic | chain_sum | gsm | humaneval | jsonl:PATH")
    e.add_argument("--strategies", nargs="+", required=True, metavar="SPEC",
                   help="strategy specs: NAME or NAME@param=v,param=v (e.g. greedy majority_vote@n=32)")
    e.add_argument("--out", required=True, help="output directory (records.jsonl, traces/, config.json)")
    e.add_argument("--limit", type=int, default=None, help="number of problems")
    e.add_argument("--seed", type=int, default=0, help="the task's problems and the samples' seeds")
    add_model_args(e, remote=True)
    e.add_argument("--max-tokens", type=int, default=None, help="every strategy's max tokens (default: their own)")
    e.add_argument("--temperature", type=float, default=None,
                   help="every sampling strategy's temperature (default: their own; greedy stays greedy)")
    e.add_argument("--prefix-cache-mb", type=int, default=512, help="each run's radix prefix cache (0: off)")
    e.add_argument("--executor", default="local", choices=("local", "ray"), help="where the runs happen")
    e.add_argument("--ray-address", default=None, help="a running Ray cluster (auto, host:port, ray://...); "
                                                       "default: start a local one")
    e.add_argument("--workers", type=int, default=None, help="Ray workers (default: one per CPU)")
    e.add_argument("--threads", type=int, default=None, help="torch threads per worker")
    e.add_argument("--force", action="store_true", help="start --out afresh when it holds another configuration")
    e.add_argument("--select", action="store_true",
                   help="after the sweep, print the compute-optimal strategy for --select-budget")
    e.add_argument("--select-budget", type=float, default=None, metavar="FLOPS",
                   help="FLOPs per problem for --select (output tokens where FLOPs are unknown; default: the largest "
                        "budget analysed)")
    e.add_argument("--difficulty", default="agreement", choices=("agreement", "pass_rate"),
                   help="how --select bins problems: agreement = answer agreement among the first 4 samples (no "
                        "ground truth, its cost charged); pass_rate = the model's pass rate over the whole pool "
                        "(Snell et al.'s oracle difficulty: reads the ground truth, not charged)")
    e.add_argument("--no-progress", action="store_true", help="no progress bar")
    e.add_argument("--json", action="store_true", help="print the summary (and selection) as one JSON object")
    e.set_defaults(run=run)


def setup_of(args: argparse.Namespace) -> Any:
    from metaloom.eval.worker import Setup

    if args.limit is not None and args.limit < 1:
        raise InvalidParameter("limit", args.limit, ">= 1 problems")
    if args.threads is not None and args.threads < 1:
        raise InvalidParameter("threads", args.threads, ">= 1")
    if args.workers is not None and args.workers < 1:
        raise InvalidParameter("workers", args.workers, ">= 1")
    if args.executor != "ray" and (args.ray_address is not None or args.workers is not None):
        raise InvalidParameter("ray-address" if args.ray_address is not None else "workers",
                               args.ray_address or args.workers, "set only with --executor ray")
    if args.select_budget is not None and not (math.isfinite(args.select_budget) and args.select_budget > 0):
        raise InvalidParameter("select-budget", args.select_budget, "FLOPs > 0")
    if args.backend == "openai" and not args.base_url:
        raise InvalidParameter("base-url", None, "the server's URL with --backend openai (e.g. http://127.0.0.1:8000)")
    if args.backend == "openai":
        refuse_local_only(args)
    engine: dict[str, Any] = dict(engine_options(args))
    template = engine.pop("chat_template_args", None)  # a Setup is hashable: the dict travels as JSON text
    return Setup(task=args.task, limit=args.limit, seed=args.seed, model=args.model, dtype=args.dtype,
                 device=args.device, backend=args.backend, weights=args.weights, **engine,
                 chat_template_args=None if template is None else json.dumps(template, sort_keys=True),
                 base_url=args.base_url,
                 api_key=args.api_key, model_params=args.model_params, tokenizer=args.tokenizer,
                 max_tokens=args.max_tokens, temperature=args.temperature, prefix_cache_mb=args.prefix_cache_mb,
                 threads=args.threads)


def summary(records: list[Any], specs: tuple[str, ...]) -> dict[str, dict[str, Any]]:
    """Per spec: problems, accuracy, mean output tokens, FLOPs, seconds and peak KV bytes (None
    where no run measured it), errors. Accuracy is
    defined as in the report and `scripts/run_tables.py` (`metaloom.eval.analysis`): a sampling
    strategy's is its expected accuracy over the order of its samples (a vote's tie goes to the
    answer seen first, and which one that is depends on the order), not the one order the run
    happened to draw; any other strategy's is what it answered."""
    from metaloom.eval.analysis.subsample import outcome
    from metaloom.eval.records import POOLED
    from metaloom.wiring.spec import parse_spec

    out: dict[str, dict[str, Any]] = {}
    for spec in specs:
        rs = [r for r in records if r.strategy == spec]
        if not rs:
            continue
        n = len(rs)
        pooled = parse_spec(spec).name in POOLED
        correct = [outcome(r, len(r.candidates) if pooled and r.candidates else None).correct for r in rs]
        out[spec] = {"problems": n, "accuracy": sum(correct) / n,
                     "output_tokens": sum(int(r.usage.get("output_tokens") or 0) for r in rs) / n,
                     "flops": sum(float(r.usage.get("flops") or 0.0) for r in rs) / n,
                     # the ledger's seconds: what the run cost (a replayed draw took no wall time here)
                     "seconds": sum(float(r.usage.get("seconds") or r.seconds) for r in rs) / n,
                     # the most KV memory a run held at once, its mean over the runs that measured it
                     "kv_bytes_peak": _mean_known([r.usage.get("kv_bytes_peak") for r in rs]),
                     "errors": sum(r.error is not None for r in rs),
                     "budget_stops": sum(r.stopped_reason == "budget" for r in rs)}
    return out


def _mean_known(values: list[Any]) -> float | None:
    """The mean of the numbers among ``values`` (None: unknown, e.g. behind a remote server)."""
    known = [float(v) for v in values if isinstance(v, int | float) and not isinstance(v, bool)]
    return sum(known) / len(known) if known else None


def table(rows: dict[str, dict[str, Any]]) -> str:
    from metaloom.present.numbers import fmt_bytes

    lines = ["| strategy | problems | accuracy | output tokens | TFLOP | seconds | peak KV | errors |",
             "|---|---|---|---|---|---|---|---|"]
    for spec, s in rows.items():
        memory = fmt_bytes(s["kv_bytes_peak"]) if s.get("kv_bytes_peak") is not None else "?"
        lines.append(f"| {spec} | {s['problems']} | {s['accuracy']:.3f} | {s['output_tokens']:.0f} | "
                     f"{s['flops'] / 1e12:.3f} | {s['seconds']:.2f} | {memory} | {s['errors']} |")
    return "\n".join(lines)


def run_line(spec: str, setup: Any) -> str:
    """The `metaloom run` command that runs ``spec`` as the sweep ran it: its model, and every
    setting of the sweep that changes what the strategy generates (dtype, weights, device,
    backend, q8 activations, max tokens, temperature, a remote server, the chat template's variables)."""
    import shlex

    parts = ["metaloom", "run", "--strategy", spec, "--model", setup.model]
    defaults = {"dtype": "float32", "device": "auto", "backend": "auto", "weights": "auto", "activations": "float"}
    for name, default in defaults.items():
        value = getattr(setup, name, default)
        if value != default:
            parts += [f"--{name.replace('_', '-')}", str(value)]
    for name in ("max_tokens", "temperature", "base_url"):
        value = getattr(setup, name)
        if value is not None:
            parts += [f"--{name.replace('_', '-')}", str(value)]
    for key, value in json.loads(getattr(setup, "chat_template_args", None) or "{}").items():
        parts += ["--chat-template-arg", f"{key}={json.dumps(value)}"]
    return " ".join(shlex.quote(p) for p in parts) + " PROMPT"


def select(records: list[Any], model: str, budget: float | None, seed: int, setup: Any = None,
           difficulty: str = "agreement") -> dict[str, Any]:
    """The compute-optimal choice at ``budget`` (default: the largest analysed) as a spec that
    `metaloom run --strategy` and the server's model aliases take: the best single strategy
    chosen on the selection half (one spec needs no difficulty probe), with the per-bin
    choices and both held-out accuracies beside it. ``seed``: the sweep's (its split); the
    rule is `metaloom.eval.analysis.pick_for_budget`, the one the report names its pick by.
    ``difficulty``: the probe the per-bin choices bin by (`metaloom.eval.analysis.difficulty`)."""
    from metaloom.eval.analysis import analyze, pick_for_budget

    analysis = analyze(records, seed=seed, difficulty=difficulty)
    chosen = analysis.get("selection")
    if not chosen or not chosen.get("rows"):
        raise InvalidParameter("select", "--select", "a sweep with problems to select on ("
                               + str(analysis.get("selection_reason") or "no selection could be made") + ")")
    try:
        got = pick_for_budget(analysis, budget)
    except InvalidParameter as exc:  # below the least budget analysed: named as the flag
        raise InvalidParameter("select-budget", budget, exc.allowed) from exc
    spec = got.strategy
    return {"budget": got.budget, "budget_metric": got.metric, "strategy": spec, "per_bin": dict(got.per_bin),
            "heldout_accuracy": got.heldout_accuracy, "compute_optimal_accuracy": got.compute_optimal_accuracy,
            "run": run_line(spec, setup) if setup is not None else f"metaloom run --strategy '{spec}' --model {model} PROMPT",
            "serve_model": f"{spec}:{model}"}


def run(args: argparse.Namespace) -> int:
    from metaloom.eval.progress import SweepProgress
    from metaloom.eval.runner import local_executor, plan_sweep, run_sweep

    setup = setup_of(args)
    sweep = plan_sweep(setup, args.strategies, args.out)  # task, specs: checked before any model loads
    executor = local_executor
    if args.executor == "ray":
        from metaloom.eval.ray_executor import make_ray_executor

        executor = make_ray_executor(address=args.ray_address, workers=args.workers)
    bar = None if args.no_progress else SweepProgress
    records = run_sweep(sweep, executor=executor, force=args.force, progress=bar)
    rows = summary(records, sweep.specs)
    chosen = select(records, args.model, args.select_budget, args.seed, sweep.setup,
                    args.difficulty) if args.select else None
    if args.json:
        print(json.dumps({"out": args.out, "summary": rows, **({"select": chosen} if chosen else {})}))
        return 0
    print(table(rows))
    if chosen:
        print(f"\nat {chosen['budget']:.3g} {chosen['budget_metric']} per problem: {chosen['strategy']} "
              f"(held-out accuracy {chosen['heldout_accuracy']}; per difficulty bin, with its probe: "
              f"{chosen['compute_optimal_accuracy']})")
        print(f"  per difficulty bin: {json.dumps(chosen['per_bin'])}")
        print(f"  {chosen['run']}")
        print(f"  server model alias: {chosen['serve_model']}")
    print(f"records: {args.out}/records.jsonl · report: metaloom report {args.out}", file=sys.stderr)
    return 0

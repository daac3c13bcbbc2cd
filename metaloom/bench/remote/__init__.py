"""`metaloom bench remote`: one test-time strategy, three ways to run it, on held-out
reasoning-gym problems — metaloom's local engine (`LocalGenerator`), metaloom's strategies on
`RemoteGenerator` against a vLLM server this benchmark starts (``--vllm VENV``), and optillm's
own versions of the strategies against that same server (``--optillm VENV``).

Strategies: ``majority_vote`` (self-consistency, ``n`` samples, answers by the registry's
``last_number`` extractor) and ``best_of_n`` (``n`` samples ranked by the registry's ``judge``
scorer, an LLM judge on the same generator). optillm runs them as its ``self_consistency``
(``AdvancedSelfConsistency`` with ``num_samples=n``: it clusters whole responses by string
similarity) and ``bon`` (``best_of_n_sampling(n=n)``: the model rates each sample 0-10).
optillm's proxy fixes self-consistency at 5 samples, so its approach code is driven directly
(what the proxy itself calls) by a small script in optillm's own venv and process.

Problems: ``--remote-problems`` from reasoning-gym (``PRESETS``; seed ``--remote-seed``, held
out from the tests' seed 2025), asked as the same chat (system + user message) on every
system; the chosen output's last number is scored by reasoning-gym's own ``score_answer``.
Sampling is the same everywhere: temperature 1.0 by default because optillm hard-codes 1.0 for
its samples, top-p 1, ``--remote-tokens`` (256) per sample, seed ``--remote-seed`` + problem
(optillm sends no seed). For each problem and strategy the systems take turns, the order
rotating per problem, so load that drifts hits all alike; one pass, no repeats (medians of
seconds per problem).

Usage check: before and after each run on the server, its Prometheus counters
(``vllm:prompt_tokens_total``, ``vllm:generation_tokens_total``,
``vllm:prompt_tokens_cached_total``) — set beside what metaloom's ledger charged (or what optillm
reported) for that run.

The package: `problems` (the problems and the chat), `systems` (metaloom's and optillm's runs of
a strategy), `metrics` (the server's counters), `outcomes` (a run's outcome, the rows),
`table`, `args` (the flags); here, the schedule (`run_all`) and the entry point.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from metaloom.bench import single_weights
from metaloom.bench.remote.args import Options, add_args, options
from metaloom.bench.remote.outcomes import Outcome, aggregate
from metaloom.bench.remote.problems import PRESETS, SYSTEM_PROMPT, Problem, make_problems
from metaloom.bench.remote.systems import Metaloom, Optillm, OptillmFailed
from metaloom.bench.remote.table import format_table

__all__ = ["HELP", "add_args", "main", "run_all"]

HELP = "one test-time strategy run locally, on a vLLM server and in optillm, on reasoning-gym problems"


def rotation(systems: Sequence[str], problem: int) -> list[str]:
    """The order the systems take their turns on ``problem``: rotated by one per problem."""
    if not systems:
        return []
    k = problem % len(systems)
    return [*systems[k:], *systems[:k]]



def run_all(systems: Mapping[str, Any], problems: Sequence[Problem], correct: Callable[[str | None, Problem], bool],
            opts: Options, log: Callable[[str], None]) -> tuple[list[Outcome], dict[str, str], int]:
    """Every problem, every strategy, every system (rotating order). A system whose process
    dies is dropped from then on. Returns the outcomes, the dropped systems with why, and how
    many problems ran."""
    from metaloom.sampling.params import SamplingParams

    outcomes: list[Outcome] = []
    dropped: dict[str, str] = {}
    started = time.perf_counter()
    done = 0
    for problem in problems:
        elapsed = time.perf_counter() - started
        if opts.deadline_s and done and elapsed + elapsed / done > opts.deadline_s:
            log(f"deadline: stopping after {done} problems ({elapsed:.0f} s)")
            break
        params = SamplingParams(temperature=opts.temperature, top_p=1.0, max_tokens=opts.max_tokens,
                                seed=opts.seed + problem.index)
        for strategy in opts.strategies:
            for name in rotation([s for s in systems if s not in dropped], problem.index):
                try:
                    o = systems[name].run(strategy, problem, opts.n, params, correct)
                except OptillmFailed as exc:
                    dropped[name] = str(exc)
                    log(f"[{name}] dropped: {exc}")
                    continue
                except Exception as exc:  # one failed run is recorded, not fatal
                    o = Outcome(name, strategy, problem.index, None, False, 0.0, error=f"{type(exc).__name__}: {exc}"[:500])
                outcomes.append(o)
                log(f"[{name}] {strategy} #{problem.index}: answer {o.answer} ({'right' if o.correct else 'wrong'}, "
                    f"gold {problem.answer}), {o.seconds:.1f} s, out {o.output_tokens} tok"
                    + (f", server gen {o.server['generation']} prompt {o.server['prompt']}" if o.server else "")
                    + (f", ERROR {o.error}" if o.error else ""))
        done += 1
    return outcomes, dropped, done


def _warm_up(systems: dict[str, Any], problem: Problem, correct: Callable[[str | None, Problem], bool],
             opts: Options, dropped: dict[str, str], log: Callable[[str], None]) -> None:
    """Each system runs each strategy once, short (n samples of 8 tokens: the batched paths
    warm), unrecorded."""
    from metaloom.sampling.params import SamplingParams

    params = SamplingParams(temperature=opts.temperature, top_p=1.0, max_tokens=8, seed=opts.seed)
    for name in list(systems):
        for strategy in opts.strategies:
            try:
                o = systems[name].run(strategy, problem, opts.n, params, correct)
            except Exception as exc:
                o = Outcome(name, strategy, -1, None, False, 0.0, error=f"{type(exc).__name__}: {exc}")
            if o.error is not None and not o.error.startswith("stopped"):
                dropped[name] = f"warm-up failed: {o.error}"
                log(f"[{name}] {dropped[name]}")
                systems.pop(name).close()
                break



def main(args: argparse.Namespace) -> int:
    from metaloom.generator import LocalGenerator
    from metaloom.models.find import resolve
    from metaloom.models.load import load

    opts = options(args)
    dtype = getattr(args, "serve_dtype", "bfloat16")
    log: Callable[[str], None] = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    problems, correct = make_problems(opts.preset, opts.problems, opts.seed)
    model_name, folder = resolve(args.model)
    loadavg = os.getloadavg()
    dropped: dict[str, str] = {}
    notes: dict[str, Any] = {}
    with contextlib.ExitStack() as stack:
        systems = _served_systems(stack, args, folder, dtype, dropped, notes, log)
        loaded = load(args.model, dtype=dtype, weights=single_weights(args))
        systems = {"metaloom": Metaloom("metaloom", LocalGenerator(loaded)), **systems}
        _warm_up(systems, problems[0], correct, opts, dropped, log)
        wall = time.perf_counter()
        outcomes, later, ran = run_all(systems, problems, correct, opts, log)
        wall = time.perf_counter() - wall
        dropped.update(later)
    result = {"model": model_name, "dtype": dtype, "options": {**dataclasses.asdict(opts), "task": PRESETS[opts.preset][0]},
              "system_prompt": SYSTEM_PROMPT, "problems_run": ran, "wall_s": wall, "rows": aggregate(outcomes),
              "skipped": dropped, "notes": notes, "cpus": os.cpu_count(), "loadavg_start": list(loadavg),
              "loadavg_end": list(os.getloadavg()), "runs": [dataclasses.asdict(o) for o in outcomes]}
    if getattr(args, "json", False):
        print(json.dumps(result))
    else:
        print(format_table(result))
    return 0 if outcomes else 1


def _served_systems(stack: contextlib.ExitStack, args: argparse.Namespace, folder: str, dtype: str,
                    dropped: dict[str, str], notes: dict[str, Any], log: Callable[[str], None]) -> dict[str, Any]:
    """The systems on the vLLM server this benchmark starts (``--vllm VENV``), held open by
    ``stack``: metaloom's strategies on a `RemoteGenerator`, and optillm (``--optillm VENV``).
    Those that cannot run are in ``dropped`` with why; start-up figures go to ``notes``."""
    from metaloom.bench.servers import StartFailed, serving, vllm_spec
    from metaloom.errors import MetaloomError
    from metaloom.generator.remote import RemoteGenerator

    vllm_venv, optillm_venv = getattr(args, "vllm", None), getattr(args, "optillm", None)
    systems: dict[str, Any] = {}
    if not vllm_venv:
        dropped["metaloom-remote"] = dropped["optillm"] = "no vLLM venv given (--vllm VENV)"
        return systems
    port = getattr(args, "port_base", 18230) + 2  # beside `bench serve`'s two ports
    spec = vllm_spec(vllm_venv, folder, port, dtype, {**os.environ, "HF_HUB_OFFLINE": "1"},
                     startup_timeout_s=getattr(args, "serve_startup_timeout", 300.0),
                     extra=("--enable-prompt-tokens-details",))  # cached tokens in usage
    log(f"[vllm] starting on port {port}")
    try:
        served = stack.enter_context(serving(spec))
    except StartFailed as exc:
        dropped["metaloom-remote"] = dropped["optillm"] = f"vLLM did not start: {exc.reason}"
        notes["vllm_output_tail"] = exc.tail
        return systems
    notes["vllm_startup_s"] = served.startup_s
    log(f"[vllm] up in {served.startup_s:.1f} s at {served.base_url}")
    try:
        remote = RemoteGenerator(served.base_url, served.model, max_concurrency=16, timeout=900.0)
    except MetaloomError as exc:  # the server is up: optillm can still run
        dropped["metaloom-remote"] = f"RemoteGenerator did not start: {type(exc).__name__}: {exc}"
    else:
        systems["metaloom-remote"] = Metaloom("metaloom-remote", remote, served.base_url)
        stack.callback(systems["metaloom-remote"].close)
        notes["remote_accounting"] = remote.accounting
    if not optillm_venv:
        dropped["optillm"] = "not asked for (--optillm VENV)"
        return systems
    log_path = stack.enter_context(tempfile.TemporaryDirectory(prefix="metaloom-bench-optillm-"))
    try:
        opt = Optillm(optillm_venv, served.base_url, served.model, os.path.join(log_path, "optillm.log"))
    except OptillmFailed as exc:
        dropped["optillm"] = str(exc)
    else:
        systems["optillm"] = opt
        stack.callback(opt.close)
        notes["optillm_version"] = opt.version
    return systems

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
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import select
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from metaloom.bench import model_args, single_weights
from metaloom.errors import InvalidParameter

# name -> (reasoning-gym task, its configuration). "addition" is the configuration of the
# tests' self-consistency check (what a 135M model gets right a fair share of the time)
PRESETS: dict[str, tuple[str, dict[str, Any]]] = {
    "addition": ("basic_arithmetic", {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1,
                                      "operators": ("+",), "allow_parentheses": False, "allow_negation": False}),
    "arithmetic": ("basic_arithmetic", {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 2,
                                        "operators": ("+", "-"), "allow_parentheses": False, "allow_negation": False}),
    "gsm": ("gsm_symbolic", {}),
}
SEED = 31337  # tests/test_meta_model.py draws its problems with seed 2025
SYSTEM_PROMPT = "You are a helpful assistant. Solve the problem and give the result as a number."
STRATEGY_NAMES = ("majority_vote", "best_of_n")
OPTILLM_APPROACH = {"majority_vote": "self_consistency", "best_of_n": "bon"}
SYSTEMS = ("metaloom", "metaloom-remote", "optillm")
# usage field charged -> the vLLM counter that counts the same thing
COUNTERS = {"generation": "vllm:generation_tokens_total", "prompt": "vllm:prompt_tokens_total",
            "cached": "vllm:prompt_tokens_cached_total", "requests": "vllm:request_success_total"}
CHECKED = (("output_tokens", "generation"), ("input_tokens", "prompt"), ("cached_tokens", "cached"))


# ---------------------------------------------------------------- pure pieces


@dataclass(frozen=True)
class Problem:
    index: int
    question: str
    answer: str
    entry: Mapping[str, Any] = field(repr=False, compare=False)  # reasoning-gym's entry, for its scorer


def make_problems(preset: str, size: int, seed: int) -> tuple[list[Problem], Callable[[str | None, Problem], bool]]:
    """``size`` problems of ``preset`` drawn with ``seed`` (the same every time), and a judge of
    an extracted answer: reasoning-gym's ``score_answer`` gives it full marks."""
    if preset not in PRESETS:
        raise InvalidParameter("remote_task", preset, f"one of {sorted(PRESETS)}")
    if size < 1:
        raise InvalidParameter("remote_problems", size, "an integer >= 1")
    import reasoning_gym

    task, config = PRESETS[preset]
    data = reasoning_gym.create_dataset(task, size=size, seed=seed, **config)
    problems = [Problem(i, str(e["question"]), str(e["answer"]), e) for i, e in enumerate(data)]

    def correct(answer: str | None, problem: Problem) -> bool:
        return answer is not None and data.score_answer(answer, dict(problem.entry)) >= 1.0

    return problems, correct


def chat(question: str) -> tuple[dict[str, str], ...]:
    """The prompt every system is sent (optillm sends exactly this pair of messages)."""
    return ({"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": question})


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text exposition -> {metric name: value summed over its label sets}. Comment
    lines and unreadable values are skipped; a trailing timestamp is ignored."""
    out: dict[str, float] = {}
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if "{" in line:
            name, rest = line[:line.index("{")], line[line.rindex("}") + 1:]
        else:
            name, _, rest = line.partition(" ")
        fields = rest.split()
        if not name or not fields:
            continue
        try:
            value = float(fields[0])
        except ValueError:
            continue
        out[name] = out.get(name, 0.0) + value
    return out


def counter_deltas(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, int]:
    """What each of `COUNTERS` grew by between two readings."""
    return {key: round(after.get(name, 0.0) - before.get(name, 0.0)) for key, name in COUNTERS.items()}


@dataclass(frozen=True)
class Outcome:
    """One strategy run of one system on one problem. Token figures are what the system itself
    says it spent (metaloom: its ledger; optillm: its reported completion tokens, no prompt
    tokens); ``server`` is what the vLLM server counted meanwhile (None: no server involved)."""

    system: str
    strategy: str
    problem: int
    answer: str | None
    correct: bool
    seconds: float
    input_tokens: int | None = None
    output_tokens: int | None = None
    cached_tokens: int | None = None
    samples: int | None = None  # samples the choice was made among (optillm drops cut-off ones)
    sample_accuracy: float | None = None  # share of those samples whose own answer is right
    server: dict[str, int] | None = None
    error: str | None = None
    # prompt tokens vLLM counts beyond the usage it returns: it runs a request for n samples as
    # n requests and counts the prompt of each; its usage (and the ledger) count it once
    fanout_tokens: int = 0


def usage_check(runs: Sequence[Outcome]) -> dict[str, dict[str, int]]:
    """Per checked field, over the runs that have both figures: the sum charged, the sum the
    server counted, and how many runs differ. Prompt tokens are compared after adding each
    run's ``fanout_tokens`` (their sum is reported as ``fanout``)."""
    out: dict[str, dict[str, int]] = {}
    for charged_field, counter in CHECKED:
        known = [o for o in runs if o.server is not None and getattr(o, charged_field) is not None]
        if not known:
            continue
        extra = [o.fanout_tokens if charged_field == "input_tokens" else 0 for o in known]
        charged = [getattr(o, charged_field) for o in known]
        server = [o.server[counter] for o in known if o.server is not None]
        out[charged_field] = {"charged": sum(charged), "server": sum(server), "fanout": sum(extra), "runs": len(known),
                              "runs_differing": sum(a + e != b for a, e, b in zip(charged, extra, server, strict=True))}
    return out


def aggregate(outcomes: Sequence[Outcome]) -> list[dict[str, Any]]:
    """One row per (system, strategy), in order of first appearance. Accuracy is over every
    problem run (a failed run counts as wrong); tokens are summed where every successful run
    knows them; seconds are per problem over the successful runs."""
    groups: dict[tuple[str, str], list[Outcome]] = {}
    for o in outcomes:
        groups.setdefault((o.system, o.strategy), []).append(o)
    rows = []
    for (system, strategy), runs in groups.items():
        ok = [o for o in runs if o.error is None]
        secs = [o.seconds for o in ok]

        def total(name: str, ok: list[Outcome] = ok) -> int | None:
            values = [getattr(o, name) for o in ok]
            return sum(values) if values and None not in values else None

        per_sample = [o.sample_accuracy for o in ok if o.sample_accuracy is not None]
        servers = [o.server for o in ok if o.server is not None]
        rows.append({
            "system": system, "strategy": strategy, "problems": len(runs), "errors": len(runs) - len(ok),
            "accuracy": sum(o.correct for o in ok) / len(runs),
            "sample_accuracy": statistics.fmean(per_sample) if per_sample else None,
            "input_tokens": total("input_tokens"), "output_tokens": total("output_tokens"),
            "cached_tokens": total("cached_tokens"),
            "samples": total("samples"),
            "seconds_total": sum(secs), "seconds_median": statistics.median(secs) if secs else None,
            "seconds_min": min(secs) if secs else None, "seconds_max": max(secs) if secs else None,
            "server": ({k: sum(s[k] for s in servers) for k in COUNTERS} if servers and len(servers) == len(ok) else None),
            "usage_check": usage_check(ok),
            "first_error": next((o.error for o in runs if o.error is not None), None),
        })
    return rows


def rotation(systems: Sequence[str], problem: int) -> list[str]:
    """The order the systems take their turns on ``problem``: rotated by one per problem."""
    if not systems:
        return []
    k = problem % len(systems)
    return [*systems[k:], *systems[:k]]


# ---------------------------------------------------------------- the systems


def read_metrics(base_url: str, settle_s: float = 2.0) -> dict[str, float]:
    """The server's counters once they stop moving: vLLM records an engine step's figures just
    after sending its outputs, so a reading right after an answer can miss the last step."""
    root = base_url.removesuffix("/v1").rstrip("/")
    last: dict[str, float] | None = None
    deadline = time.monotonic() + settle_s
    while True:
        with urllib.request.urlopen(f"{root}/metrics", timeout=10) as r:
            now = parse_metrics(r.read().decode("utf-8", "replace"))
        if last is not None and all(now.get(n) == last.get(n) for n in COUNTERS.values()):
            return now
        if time.monotonic() > deadline:
            return now
        last = now
        time.sleep(0.05)


def fanout_tokens(trace: Sequence[Any]) -> int:
    """(n - 1) x the prompt tokens of each sampling request in a strategy's trace (its "sample"
    events carry n and the usage of that request)."""
    return sum((int(e.data.get("n", 1)) - 1) * int(e.data.get("usage", {}).get("input_tokens", 0))
               for e in trace if e.kind == "sample")


class Metaloom:
    """metaloom's strategies, from the registry, on a `Generator` (local or remote)."""

    def __init__(self, name: str, generator: Any, metrics_url: str | None = None) -> None:
        self.name, self.generator, self.metrics_url = name, generator, metrics_url

    def strategy(self, name: str, n: int, params: Any) -> Any:
        from metaloom.wiring.registry import EXTRACTORS, SCORERS, STRATEGIES, lookup

        extractor = lookup("extractor", EXTRACTORS, "last_number")()
        extra = {"scorer": lookup("scorer", SCORERS, "judge")(generator=self.generator)} if name == "best_of_n" else {}
        return lookup("strategy", STRATEGIES, name)(n=n, extractor=extractor, params=params, **extra)

    def run(self, strategy: str, problem: Problem, n: int, params: Any,
            correct: Callable[[str | None, Problem], bool]) -> Outcome:
        from metaloom.ledger import Ledger
        from metaloom.score.answers import LastNumber

        run = self.strategy(strategy, n, params)
        before = read_metrics(self.metrics_url) if self.metrics_url else None
        ledger = Ledger()
        start = time.perf_counter()
        result = run.run(chat(problem.question), self.generator, ledger=ledger)
        seconds = time.perf_counter() - start
        server = None
        if self.metrics_url is not None and before is not None:
            server = counter_deltas(before, read_metrics(self.metrics_url))
        answer = LastNumber().extract(result.best)
        rights = [correct(a, problem) for a in result.answers]
        u = ledger.usage
        return Outcome(self.name, strategy, problem.index, answer, correct(answer, problem), seconds,
                       u.input_tokens, u.output_tokens, u.cached_tokens, len(result.candidates),
                       statistics.fmean(rights) if rights else None, server,
                       None if result.stopped_reason is None else f"stopped: {result.stopped_reason}",
                       fanout_tokens(result.trace))

    def close(self) -> None:
        close = getattr(self.generator, "close", None)
        if close is not None:
            close()


# Runs in optillm's venv: reads one JSON request per line, answers one JSON line. Replies go to
# a copy of the real stdout; anything the libraries print goes to stderr (the log).
OPTILLM_DRIVER = r'''
import json, os, sys, time
out = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)
def reply(obj):
    out.write(json.dumps(obj) + "\n"); out.flush()
try:
    import openai, optillm
    from optillm.self_consistency import AdvancedSelfConsistency
    from optillm.bon import best_of_n_sampling
except Exception as exc:
    reply({"error": "cannot import optillm: %s: %s" % (type(exc).__name__, exc)}); sys.exit(1)
reply({"ready": True, "version": getattr(optillm, "__version__", "?")})
client = None
for line in sys.stdin:
    req = json.loads(line)
    try:
        if client is None:
            client = openai.OpenAI(base_url=req["base_url"], api_key="none", max_retries=0, timeout=900)
        config = {"max_tokens": req["max_tokens"]}
        start = time.perf_counter()
        if req["approach"] == "self_consistency":  # as optillm's advanced_self_consistency_approach, n samples
            sc = AdvancedSelfConsistency(client, req["model"], num_samples=req["n"], request_config=config)
            result = sc.evaluate(req["system"], req["query"])
            clusters = result["aggregated_result"]["clusters"]
            text = clusters[0]["answer"] if clusters else "No consistent answer found."
            reply({"text": text, "samples": result["individual_responses"],
                   "completion_tokens": sc.self_consistency_completion_tokens, "seconds": time.perf_counter() - start})
        elif req["approach"] == "bon":
            text, tokens = best_of_n_sampling(req["system"], req["query"], client, req["model"], n=req["n"],
                                              request_config=config)
            reply({"text": text, "samples": None, "completion_tokens": tokens, "seconds": time.perf_counter() - start})
        else:
            reply({"error": "unknown approach %r" % req["approach"]})
    except Exception as exc:
        reply({"error": "%s: %s" % (type(exc).__name__, exc)})
'''


class OptillmFailed(Exception):
    pass


class Optillm:
    """optillm's approaches in its own venv's Python, one process for the whole benchmark."""

    name = "optillm"

    def __init__(self, venv: str, base_url: str, model: str, log_path: str, startup_timeout_s: float = 120.0,
                 call_timeout_s: float = 1800.0) -> None:
        python = os.path.join(venv, "bin", "python")
        if not os.path.exists(python):
            raise OptillmFailed(f"{python} does not exist (create it: python3 -m venv {venv} && "
                                f"{venv}/bin/pip install optillm)")
        self.base_url, self.model, self.log_path, self.call_timeout_s = base_url, model, log_path, call_timeout_s
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "OPENAI_API_KEY": "none"}
        with open(log_path, "ab") as log:
            self.proc = subprocess.Popen([python, "-c", OPTILLM_DRIVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=log, env=env, start_new_session=True)
        hello = self._read(startup_timeout_s)
        if "error" in hello:
            self.close()
            raise OptillmFailed(hello["error"])
        self.version = str(hello.get("version"))

    def _read(self, timeout_s: float) -> dict[str, Any]:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        line = self.proc.stdout.readline() if ready else b""
        if not line:
            self.close()
            why = f"gave no answer within {timeout_s:.0f} s" if not ready else f"exited with status {self.proc.poll()}"
            from metaloom.bench.serve import tail

            raise OptillmFailed(f"optillm's process {why}; its log: {tail(self.log_path, 1500)}")
        return dict(json.loads(line))

    def run(self, strategy: str, problem: Problem, n: int, params: Any,
            correct: Callable[[str | None, Problem], bool]) -> Outcome:
        from metaloom.score.answers import LastNumber

        assert self.proc.stdin is not None
        request = {"approach": OPTILLM_APPROACH[strategy], "system": SYSTEM_PROMPT, "query": problem.question,
                   "n": n, "max_tokens": params.max_tokens, "base_url": self.base_url, "model": self.model}
        before = read_metrics(self.base_url)
        start = time.perf_counter()
        self.proc.stdin.write((json.dumps(request) + "\n").encode())
        self.proc.stdin.flush()
        reply = self._read(self.call_timeout_s)
        seconds = time.perf_counter() - start
        server = counter_deltas(before, read_metrics(self.base_url))
        if "error" in reply:
            return Outcome(self.name, strategy, problem.index, None, False, seconds, server=server, error=reply["error"])
        extract = LastNumber().extract
        answer = extract(str(reply["text"]))
        samples = reply.get("samples")
        rights = [correct(extract(str(s)), problem) for s in samples] if samples is not None else []
        return Outcome(self.name, strategy, problem.index, answer, correct(answer, problem), seconds,
                       None, int(reply["completion_tokens"]), None, len(samples) if samples is not None else None,
                       statistics.fmean(rights) if rights else None, server)

    def close(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(OSError):
                assert self.proc.stdin is not None
                self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(self.proc.pid, signal.SIGKILL)  # its own session: only what we started
                self.proc.wait()


# ---------------------------------------------------------------- the benchmark


@dataclass(frozen=True)
class Options:
    preset: str = "addition"
    problems: int = 20
    seed: int = SEED
    n: int = 16
    max_tokens: int = 256
    temperature: float = 1.0
    strategies: tuple[str, ...] = STRATEGY_NAMES
    deadline_s: float = 0.0  # 0: none; else no new problem starts once the next would likely end past it

    def __post_init__(self) -> None:
        for name in ("problems", "n", "max_tokens"):
            if getattr(self, name) < 1:
                raise InvalidParameter(f"remote_{name}", getattr(self, name), "an integer >= 1")
        if not self.strategies or any(s not in STRATEGY_NAMES for s in self.strategies):
            raise InvalidParameter("remote_strategies", ",".join(self.strategies), f"some of {STRATEGY_NAMES}")
        if self.deadline_s < 0:
            raise InvalidParameter("remote_deadline", self.deadline_s, "seconds >= 0 (0: none)")


def options(args: argparse.Namespace) -> Options:
    strategies = tuple(s.strip() for s in str(getattr(args, "remote_strategies", ",".join(STRATEGY_NAMES))).split(",")
                       if s.strip())
    return Options(preset=getattr(args, "remote_task", "addition"), problems=getattr(args, "remote_problems", 20),
                   seed=getattr(args, "remote_seed", SEED), n=getattr(args, "remote_n", 16),
                   max_tokens=getattr(args, "remote_tokens", 256), temperature=getattr(args, "remote_temperature", 1.0),
                   strategies=strategies, deadline_s=getattr(args, "remote_deadline", 0.0))


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
    from metaloom.bench.serve import StartFailed, serving, vllm_spec
    from metaloom.errors import MetaloomError
    from metaloom.generator import LocalGenerator
    from metaloom.generator.remote import RemoteGenerator
    from metaloom.models.load import load, resolve

    opts = options(args)
    dtype = getattr(args, "serve_dtype", "bfloat16")
    vllm_venv, optillm_venv = getattr(args, "vllm", None), getattr(args, "optillm", None)
    log: Callable[[str], None] = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    problems, correct = make_problems(opts.preset, opts.problems, opts.seed)
    model_name, folder = resolve(args.model)
    loadavg = os.getloadavg()
    dropped: dict[str, str] = {}
    notes: dict[str, Any] = {}
    with contextlib.ExitStack() as stack:
        systems: dict[str, Any] = {}
        if vllm_venv:
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
            else:
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
                if optillm_venv:
                    log_path = stack.enter_context(tempfile.TemporaryDirectory(prefix="metaloom-bench-optillm-"))
                    try:
                        opt = Optillm(optillm_venv, served.base_url, served.model, os.path.join(log_path, "optillm.log"))
                    except OptillmFailed as exc:
                        dropped["optillm"] = str(exc)
                    else:
                        systems["optillm"] = opt
                        stack.callback(opt.close)
                        notes["optillm_version"] = opt.version
                else:
                    dropped["optillm"] = "not asked for (--optillm VENV)"
        else:
            dropped["metaloom-remote"] = dropped["optillm"] = "no vLLM venv given (--vllm VENV)"
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


HELP = "one test-time strategy run locally, on a vLLM server and in optillm, on reasoning-gym problems"


def add_args(p: argparse.ArgumentParser) -> None:
    from metaloom.bench.serve import server_args

    model_args(p, repeats=None)
    server_args(p)
    p.add_argument("--optillm", default=None, metavar="VENV", help="an optillm venv to run beside metaloom")
    p.add_argument("--remote-task", default="addition", choices=sorted(PRESETS), help="reasoning-gym preset")
    p.add_argument("--remote-problems", type=int, default=20, help="problems")
    p.add_argument("--remote-seed", type=int, default=SEED, help="problem seed (sample seeds: this + problem)")
    p.add_argument("--remote-n", type=int, default=16, help="samples per strategy run")
    p.add_argument("--remote-tokens", type=int, default=256, help="max_tokens of each sample")
    p.add_argument("--remote-temperature", type=float, default=1.0,
                   help="sampling temperature (optillm hard-codes 1.0)")
    p.add_argument("--remote-strategies", default=",".join(STRATEGY_NAMES), help="comma-separated")
    p.add_argument("--remote-deadline", type=float, default=0.0,
                   help="seconds after which no new problem starts (0: none)")


# ---------------------------------------------------------------- the table


def _n(x: int | None) -> str:
    return "-" if x is None else f"{x:,}"


def _f(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def format_table(result: Mapping[str, Any]) -> str:
    o = result["options"]
    lines = [f"{result['model']} ({result['dtype']}): {result['problems_run']} of {o['problems']} reasoning-gym "
             f"{o['task']} problems ('{o['preset']}', seed {o['seed']}), n={o['n']}, temperature {o['temperature']}, "
             f"max_tokens {o['max_tokens']}, one pass in {result['wall_s']:.0f} s",
             f"load average at start {' '.join(f'{v:.2f}' for v in result['loadavg_start'])}, "
             f"at end {' '.join(f'{v:.2f}' for v in result['loadavg_end'])} ({result['cpus']} CPUs)",
             f"{'system':16s} {'strategy':16s} {'acc':>5s} {'per-sample':>10s} {'prompt tok':>10s} {'output tok':>10s} "
             f"{'s/problem median (min-max)':>27s} {'total s':>8s} {'errors':>6s}"]
    for r in result["rows"]:
        label = r["strategy"] if r["system"] != "optillm" else OPTILLM_APPROACH.get(r["strategy"], r["strategy"])
        prompt = r["input_tokens"] if r["input_tokens"] is not None else (r["server"] or {}).get("prompt")
        mark = "" if r["input_tokens"] is not None or prompt is None else "*"
        spread = f"{_f(r['seconds_median'], 1)} ({_f(r['seconds_min'], 1)}-{_f(r['seconds_max'], 1)})"
        lines.append(f"{r['system']:16s} {label:16s} {r['accuracy']:5.2f} {_f(r['sample_accuracy']):>10s} "
                     f"{_n(prompt) + mark:>10s} {_n(r['output_tokens']):>10s} {spread:>27s} {r['seconds_total']:8.1f} "
                     f"{r['errors']:6d}")
    if any(r["system"] == "optillm" and r["input_tokens"] is None for r in result["rows"]):
        lines.append("* optillm reports no prompt tokens: the server's count")
    checked = [r for r in result["rows"] if r["usage_check"]]
    if checked:
        lines.append("usage check, summed over the runs: charged by the system (metaloom: ledger; optillm: its "
                     "completion_tokens) / counted by vLLM (/metrics) [runs that differ]")
        lines.append(f"{'system':16s} {'strategy':16s} {'output tokens':>24s} {'prompt tokens':>30s} {'cached tokens':>22s}")
        for r in checked:
            cells = []
            for name in ("output_tokens", "input_tokens", "cached_tokens"):
                c = r["usage_check"].get(name)
                fan = f" +{c['fanout']:,}" if c is not None and c["fanout"] else ""
                cells.append("-" if c is None else f"{c['charged']:,}{fan} / {c['server']:,} [{c['runs_differing']}/{c['runs']}]")
            label = r["strategy"] if r["system"] != "optillm" else OPTILLM_APPROACH.get(r["strategy"], r["strategy"])
            lines.append(f"{r['system']:16s} {label:16s} {cells[0]:>24s} {cells[1]:>30s} {cells[2]:>22s}")
        if any(r["usage_check"].get("input_tokens", {}).get("fanout") for r in checked):
            lines.append("prompt +N: vLLM runs a request for n samples as n requests and counts each one's prompt; "
                         "its usage (the ledger's source) counts it once: N = (n - 1) x the sampling prompts")
        lines.append("vLLM's request counter over those runs: " + ", ".join(
            f"{r['system']} {r['strategy']} {r['server']['requests']:,}" for r in checked if r["server"]))
    for r in result["rows"]:
        if r["first_error"]:
            lines.append(f"{r['system']} {r['strategy']}: first error: {r['first_error']}")
    for name, why in result["skipped"].items():
        lines.append(f"{name} skipped: {why}")
    return "\n".join(lines)

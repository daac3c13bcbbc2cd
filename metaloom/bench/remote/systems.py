"""The systems of `metaloom bench remote`, each running a strategy on a problem into an
`Outcome`: `Metaloom` (the registry's strategies on a local or remote `Generator`) and `Optillm`
(optillm's own versions of the strategies, driven in its venv's Python)."""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import statistics
import subprocess
import time
from collections.abc import Callable, Sequence
from typing import Any

from metaloom.bench.remote.metrics import counter_deltas, read_metrics
from metaloom.bench.remote.outcomes import Outcome
from metaloom.bench.remote.problems import SYSTEM_PROMPT, Problem, chat

STRATEGY_NAMES = ("majority_vote", "best_of_n")
OPTILLM_APPROACH = {"majority_vote": "self_consistency", "best_of_n": "bon"}
SYSTEMS = ("metaloom", "metaloom-remote", "optillm")


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
            from metaloom.bench.servers import tail

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

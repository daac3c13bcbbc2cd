"""Systems measured side by side, each in its own worker process (`metaloom.bench.peers.worker`,
run by the interpreter of the system's own venv), driven from here over JSON lines.

`measure` loads every system once (not timed), then for each case runs one warm-up round and
``repeats`` timed rounds, alternating the systems within each round (A B C A B C ...) so load
that drifts on a shared machine hits them alike; between two calls it waits ``settle_s`` so the
machine settles, and it keeps every worker but the one asked stopped (SIGSTOP), so idle
engines' polling threads take nothing from the system being timed. A system that
cannot start (missing interpreter, import error, crash while loading) is *skipped* with its
reason; one that fails or crashes later, or generates a different number of tokens than asked,
gets an *error* on that case; neither stops the others.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import IO, Any

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "worker.py")


@dataclass(frozen=True)
class SystemSpec:
    """One row of the report: ``system`` (a key of the worker's ``SYSTEMS``) built from
    ``config`` by ``python`` in ``env`` (None: ours). ``fallback`` is started instead when this
    one *crashes* while loading (e.g. llama.cpp's AMX kernels), with ``fallback_note`` recorded."""

    name: str
    system: str
    python: str
    config: Mapping[str, Any]
    env: Mapping[str, str] | None = None
    fallback: SystemSpec | None = None
    fallback_note: str = ""


class WorkerFailed(Exception):
    """A request got no good reply; ``crashed``: the process is gone (or was killed, hung)."""

    def __init__(self, reason: str, crashed: bool) -> None:
        super().__init__(reason)
        self.reason, self.crashed = reason, crashed


class Worker:
    """A worker process started and loaded (`WorkerFailed` if it cannot be)."""

    def __init__(self, spec: SystemSpec, cases: Mapping[str, Any], threads: int, load_timeout_s: float) -> None:
        self.spec = spec
        if not os.path.exists(spec.python):
            raise WorkerFailed(f"{spec.python} does not exist", crashed=False)
        self._stderr = tempfile.TemporaryFile()  # noqa: SIM115  # read back for the reason of a failure
        self.proc = subprocess.Popen([spec.python, WORKER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self._stderr, env=dict(spec.env) if spec.env is not None else None,
                                     text=True, start_new_session=True)  # own group: a kill takes its children too
        self._lines: queue.Queue[str | None] = queue.Queue()
        assert self.proc.stdout is not None
        self._pump = threading.Thread(target=_pump, args=(self.proc.stdout, self._lines), daemon=True)
        self._pump.start()
        try:
            reply = self.request({"op": "load", "system": spec.system, "config": dict(spec.config), "cases": dict(cases),
                                  "threads": threads}, load_timeout_s)
        except WorkerFailed:
            self.close()
            raise
        self.info: dict[str, Any] = reply.get("info", {})

    def request(self, msg: Mapping[str, Any], timeout_s: float) -> dict[str, Any]:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps(msg) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            raise WorkerFailed(self._exit_reason(), crashed=True) from None
        try:
            line = self._lines.get(timeout=timeout_s)
        except queue.Empty:
            self.kill()
            why = f"no reply to {msg.get('op')!r} in {timeout_s:g} s (killed){self._tail()}"
            raise WorkerFailed(why, crashed=True) from None
        if line is None:
            raise WorkerFailed(self._exit_reason(), crashed=True)
        try:
            reply = json.loads(line)
        except json.JSONDecodeError:
            self.kill()
            raise WorkerFailed(f"garbled reply {line[:200]!r}", crashed=True) from None
        if not reply.get("ok"):
            raise WorkerFailed(str(reply.get("error", "failed without a message")), crashed=False)
        return reply

    def _exit_reason(self) -> str:
        try:
            code = self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.kill()
            code = self.proc.wait()
        how = f"killed by signal {-code}" if code < 0 else f"exit status {code}"
        return f"worker exited ({how}){self._tail()}"

    def _tail(self, lines: int = 3) -> str:
        self._stderr.flush()
        self._stderr.seek(0, os.SEEK_END)
        size = self._stderr.tell()
        self._stderr.seek(max(0, size - 4096))
        text = self._stderr.read().decode(errors="replace")
        tail = [s.strip() for s in text.splitlines() if s.strip()][-lines:]
        return (": " + " | ".join(tail)) if tail else ""

    def pause(self) -> None:
        """Stop the worker's process group (SIGSTOP) while other systems run: an idle engine's
        polling threads, or OpenMP threads still spinning after a call, then take no CPU from
        them. (Were we to die meanwhile, the kernel wakes an orphaned stopped group with SIGHUP.)"""
        self._signal(signal.SIGSTOP)
        deadline = time.monotonic() + 2.0  # the signal is delivered asynchronously: see it taken
        while self.proc.poll() is None and _state(self.proc.pid) not in ("T", "t", None) and time.monotonic() < deadline:
            time.sleep(0.001)

    def resume(self) -> None:
        self._signal(signal.SIGCONT)

    def _signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)

    def kill(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)  # the group this worker leads (start_new_session)
            self.proc.wait()

    def close(self) -> None:
        """Ask the worker to quit; kill it if it does not within 30 s."""
        self.resume()
        if self.proc.poll() is None:
            try:
                self.request({"op": "quit"}, 30)
                self.proc.wait(timeout=30)
            except (WorkerFailed, subprocess.TimeoutExpired):
                pass
        self.kill()
        self._pump.join(timeout=5)  # at end of output now that the process is gone
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                with contextlib.suppress(OSError):  # stdin's last bytes to a dead process
                    stream.close()
        self._stderr.close()


def _state(pid: int) -> str | None:
    """A process's state letter (R, S, T for stopped ...), None where /proc cannot tell."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def _pump(stream: IO[str], lines: queue.Queue[str | None]) -> None:
    for line in stream:
        lines.put(line)
    lines.put(None)


@dataclass
class CaseOutcome:
    """Timed seconds (warm-up excluded), tokens per call, or why the case has no result."""

    seconds: list[float] = field(default_factory=list)
    tokens: int | None = None
    error: str | None = None


@dataclass
class SystemRun:
    spec: SystemSpec
    info: dict[str, Any]
    outcomes: dict[str, CaseOutcome]
    note: str | None = None


def start(spec: SystemSpec, cases: Mapping[str, Any], threads: int, load_timeout_s: float) -> tuple[Worker, str | None]:
    """The worker for ``spec`` or, when that one crashes while loading, for its fallback."""
    try:
        return Worker(spec, cases, threads, load_timeout_s), None
    except WorkerFailed as exc:
        if not exc.crashed or spec.fallback is None:
            raise
        worker, _ = start(spec.fallback, cases, threads, load_timeout_s)
        return worker, f"{spec.fallback_note}: {exc.reason}"


def measure(specs: Sequence[SystemSpec], cases: Mapping[str, Mapping[str, Any]], *, repeats: int, threads: int,
            warmup: int = 1, settle_s: float = 0.2, load_timeout_s: float = 900.0, run_timeout_s: float = 900.0,
            pause_idle: bool = True, log: Callable[[str], None] = lambda _: None) -> tuple[list[SystemRun], dict[str, str]]:
    """Run every case on every system (see the module docstring). Returns the systems that
    started, in ``specs`` order, and {name: reason} for those skipped. ``cases`` maps a name to
    the worker's case spec; each call must generate ``n * max_tokens`` tokens."""
    expected = {name: int(c["n"]) * int(c["max_tokens"]) for name, c in cases.items()}
    runs: list[SystemRun] = []
    skipped: dict[str, str] = {}
    workers: dict[str, Worker] = {}
    try:
        for spec in specs:
            log(f"[{spec.name}] loading")
            try:
                workers[spec.name], note = start(spec, cases, threads, load_timeout_s)
            except WorkerFailed as exc:
                skipped[spec.name] = exc.reason
                log(f"[{spec.name}] skipped: {exc.reason}")
                continue
            started = workers[spec.name]  # its spec: the fallback's, when that is what runs
            runs.append(SystemRun(started.spec, started.info, {c: CaseOutcome() for c in cases}, note))
            if pause_idle:
                workers[spec.name].pause()
        for case in cases:
            log(f"case {case}: {warmup} warm-up + {repeats} timed rounds over {len(workers)} systems")
            for round_ in range(warmup + repeats):
                for run in runs:
                    out = run.outcomes[case]
                    if out.error is not None or run.spec.name not in workers:
                        continue
                    worker = workers[run.spec.name]
                    worker.resume()
                    time.sleep(settle_s)
                    try:
                        reply = worker.request({"op": "run", "case": case}, run_timeout_s)
                    except WorkerFailed as exc:
                        out.error = exc.reason
                        if exc.crashed:
                            workers.pop(run.spec.name).close()
                            for other in run.outcomes.values():
                                if other.error is None and other.tokens is None:
                                    other.error = f"not run: the worker died during case {case!r}"
                        log(f"[{run.spec.name}] {case}: {out.error}")
                        continue
                    finally:
                        if pause_idle and run.spec.name in workers:
                            worker.pause()
                    tokens = int(reply["tokens"])
                    if tokens != expected[case]:
                        out.error = f"generated {tokens} tokens, expected {expected[case]}"
                        log(f"[{run.spec.name}] {case}: {out.error}")
                        continue
                    out.tokens = tokens
                    if round_ >= warmup:
                        out.seconds.append(float(reply["seconds"]))
                    which = "warm-up" if round_ < warmup else f"round {round_ - warmup + 1}"
                    log(f"[{run.spec.name}] {case} {which}: {reply['seconds']:.3f} s, {tokens} tokens")
    except BaseException:  # interrupted (^C) or broken: do not wait for busy workers to finish a call
        for worker in workers.values():
            worker.kill()
        raise
    finally:
        for worker in workers.values():
            worker.close()
    return runs, skipped

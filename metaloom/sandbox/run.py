"""Run untrusted Python (model-written code, verifier tests) in a child process that cannot
hang the caller, exhaust its memory, reach the network, or leave files behind.

Isolation, strongest available first (``SandboxLimits.network`` picks; ``"auto"`` takes the
namespace mode when this machine allows it):

``namespace`` (Linux, root or unprivileged user namespaces; needs ``unshare`` from util-linux)
  - network: a fresh network namespace — no interface but a loopback that is down, so every
    connection fails in the kernel (ENETUNREACH) before a packet exists, for the code and for
    any process it starts;
  - processes: a fresh PID namespace whose init is our runner; when the code's process ends
    or the run is killed, the kernel kills everything left in the namespace;
  - files: a fresh mount namespace in which every mount is read-only except the temporary
    working directory and a private /dev/shm (a tmpfs capped at the memory limit, gone with
    the namespace); all capabilities dropped and no_new_privs set, so the code cannot
    remount, raise its limits, or regain privileges through a set-uid program.
  Limits: the code runs as the caller's user and can *read* what that user can read (but can
  only hand it back through its own output); there is no cap on the number of processes
  (RLIMIT_NPROC does not bind root) beyond the wall-time kill; RLIMIT_AS bounds each process,
  not their sum.

``hook`` (fallback, any POSIX system)
  - an audit hook (PEP 578) installed before the code runs refuses socket creation and
    process creation (fork, exec, spawn, subprocess, os.system);
  - the caller kills the whole process group on timeout.
  Limits: best effort against accidental misuse, not against a hostile program — C-level code
  (ctypes, an extension module) can bypass the hook; the file system outside the working
  directory is not protected.

Both modes: a wall-time limit enforced by the caller (SIGKILL to the process group), CPU time,
address space, file size and core limits (setrlimit, soft = hard), a fresh temporary working
directory removed afterwards, a clean environment, ``python -I`` (no PYTHON* variables, no
user site-packages, script directory not on sys.path), stdin/stdout/stderr through files, so
no pipe can fill up and block either side. Each run starts a fresh interpreter (about 0.1 s on
an idle machine): isolation is per run, nothing is reused.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from metaloom.errors import InvalidParameter, MetaloomError
from metaloom.sandbox import _runner

STATUSES = ("passed", "failed", "timeout", "memory", "error")
NETWORK_MODES = ("auto", "namespace", "hook")
_UNSHARE_FLAGS = ("--net", "--pid", "--mount-proc", "--fork", "--kill-child")
_FAILURE_CHARS = 2000


class SandboxError(MetaloomError):
    """The sandbox could not isolate the code, so it did not run it."""


@dataclass(frozen=True)
class SandboxLimits:
    """How much one run may take. ``memory_mb`` is address space (RLIMIT_AS) per process;
    ``output_kb`` is how much of the end of stdout and of stderr is kept; ``file_mb`` caps
    each file the code writes (stdout and stderr included)."""

    timeout_s: float = 5.0
    memory_mb: int = 512
    file_mb: int = 16
    output_kb: int = 64
    network: str = "auto"

    def __post_init__(self) -> None:
        if not (math.isfinite(self.timeout_s) and self.timeout_s > 0):
            raise InvalidParameter("timeout_s", self.timeout_s, "a finite number of seconds > 0")
        for name in ("memory_mb", "file_mb", "output_kb"):
            value = getattr(self, name)
            if not (isinstance(value, int) and value > 0):
                raise InvalidParameter(name, value, "an integer > 0")
        if self.memory_mb < 64:  # below this the interpreter cannot import the standard library
            raise InvalidParameter("memory_mb", self.memory_mb, "at least 64")
        if self.network not in NETWORK_MODES:
            raise InvalidParameter("network", self.network, f"one of {NETWORK_MODES}")


@dataclass(frozen=True)
class SandboxResult:
    """One run. ``status``: "passed" (exit status 0), "failed" (non-zero exit: an uncaught
    exception such as a failed assert, a syntax error, ``sys.exit(n)``), "timeout" (wall or
    CPU time limit), "memory" (memory limit), "error" (killed by another signal).
    ``failure`` explains a status other than "passed" (traceback tail); ``mode`` is the
    isolation that was used ("namespace" or "hook"); ``exit_code`` is ``None`` after a
    timeout. The runner reserves exit status 97 (MemoryError) and 98 (setup failed), and in
    namespace mode a status above 128 reads as death by signal ``status - 128`` (as in a
    shell), so a program exiting with one of those on purpose is misread — as a non-pass
    either way."""

    status: str
    exit_code: int | None
    stdout: str
    stderr: str
    failure: str
    duration_s: float
    mode: str

    @property
    def passed(self) -> bool:
        return self.status == "passed"


@functools.cache  # what the machine allows does not change while we run
def namespaces_available() -> bool:
    """Whether the ``namespace`` mode works here: an empty program run in it, so that every
    step (namespaces, read-only remounts, dropping capabilities) is tried once."""
    if shutil.which("unshare") is None or not sys.platform.startswith("linux"):
        return False
    try:
        return _run("", "", SandboxLimits(timeout_s=20.0), "namespace").passed
    except (OSError, SandboxError):
        return False


def _user_flags() -> tuple[str, ...]:
    # without root, a user namespace (mapping us to root inside it) grants the rights to make
    # the others; as root it would only add a layer
    return () if os.geteuid() == 0 else ("--user", "--map-root-user")


def resolve_mode(network: str) -> str:
    """The isolation mode ``network`` means on this machine."""
    if network == "hook":
        return "hook"
    if namespaces_available():
        return "namespace"
    if network == "namespace":
        raise InvalidParameter("network", network, "'auto' or 'hook' here: `unshare --net --pid --mount` is not permitted")
    return "hook"


def _clean_env(workdir: str) -> dict[str, str]:
    # nothing of the caller's environment (tokens, proxies, PYTHON* paths) reaches the code;
    # one thread per numeric library so a numpy import stays inside the memory limit
    one = "1"
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8",
            "OMP_NUM_THREADS": one, "OPENBLAS_NUM_THREADS": one, "MKL_NUM_THREADS": one}


def _tail(path: Path, limit: int) -> str:
    with path.open("rb") as f:
        f.seek(max(0, path.stat().st_size - limit))
        return f.read().decode("utf-8", errors="replace")


def _kill_group(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):  # already gone
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _classify(code: int, mode: str, timed_out: bool, stderr: str, limits: SandboxLimits) -> tuple[str, str]:
    """(status, failure) of a finished run. Namespace mode reports a signal as ``128 + n``
    (the runner is the namespace's init), hook mode as ``-n`` (Popen)."""
    tail = stderr.strip()[-_FAILURE_CHARS:]
    if timed_out:
        return "timeout", f"timed out after {limits.timeout_s:g} s" + (f"\n{tail}" if tail else "")
    if code == _runner.EXIT_SETUP:
        raise SandboxError(f"sandbox setup failed ({mode} mode): {tail}")
    signum = -code if code < 0 else (code - 128 if mode == "namespace" and code > 128 else 0)
    if code == _runner.EXIT_MEMORY:
        return "memory", f"memory limit of {limits.memory_mb} MiB exceeded" + (f"\n{tail}" if tail else "")
    if signum == signal.SIGXCPU:
        return "timeout", "CPU time limit exceeded"
    if signum == signal.SIGKILL:  # not ours (we did not time out): the kernel's out-of-memory killer
        return "memory", "killed (SIGKILL), most likely out of memory"
    if signum:
        return "error", f"killed by signal {signal.Signals(signum).name}" + (f"\n{tail}" if tail else "")
    if code == 0:
        return "passed", ""
    return "failed", tail or f"exit status {code}"


def run_python(code: str, *, stdin: str = "", limits: SandboxLimits | None = None) -> SandboxResult:
    """Run ``code`` as a Python program (``__name__ == "__main__"``) in the sandbox, with
    ``stdin`` as its standard input. Never raises for what the code does; raises
    `SandboxError` when isolation could not be set up (the code did not run)."""
    limits = limits or SandboxLimits()
    return _run(code, stdin, limits, resolve_mode(limits.network))


def _run(code: str, stdin: str, limits: SandboxLimits, mode: str) -> SandboxResult:
    with tempfile.TemporaryDirectory(prefix="metaloom-sandbox-") as root:
        io, work = Path(root, "io"), Path(root, "work")
        io.mkdir()
        work.mkdir()
        (io / "source.py").write_text(code, encoding="utf-8")
        (io / "stdin").write_text(stdin, encoding="utf-8")
        config = {"mode": mode, "workdir": str(work), "source_path": str(io / "source.py"),
                  "memory_bytes": limits.memory_mb << 20, "file_bytes": limits.file_mb << 20,
                  "cpu_seconds": math.ceil(limits.timeout_s) + 1}  # backstop: wall time is the real limit
        (io / "config.json").write_text(json.dumps(config), encoding="utf-8")
        argv = [sys.executable, "-I", "-B", "-u", _runner.__file__, str(io / "config.json")]
        if mode == "namespace":
            argv = [shutil.which("unshare") or "unshare", *_user_flags(), *_UNSHARE_FLAGS, *argv]
        with (io / "stdin").open("rb") as fin, (io / "stdout").open("wb") as fout, (io / "stderr").open("wb") as ferr:
            start = time.monotonic()
            # own session: the whole group can be killed without touching the caller
            proc = subprocess.Popen(argv, stdin=fin, stdout=fout, stderr=ferr, cwd=work, env=_clean_env(str(work)),
                                    start_new_session=True, close_fds=True)
            timed_out = False
            try:
                proc.wait(timeout=limits.timeout_s)
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:  # also on KeyboardInterrupt: never leave the child running
                if proc.poll() is None:
                    _kill_group(proc)
            duration = time.monotonic() - start
        keep = limits.output_kb << 10
        stdout, stderr = _tail(io / "stdout", keep), _tail(io / "stderr", keep)
    status, failure = _classify(proc.returncode, mode, timed_out, stderr, limits)
    return SandboxResult(status, None if timed_out else proc.returncode, stdout, stderr, failure, duration, mode)

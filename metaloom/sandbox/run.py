"""Run untrusted Python (model-written code, verifier tests) in a child process that cannot
hang the caller, exhaust its memory, reach the network, or leave files behind.

Isolation, strongest available first (``SandboxLimits.network`` picks; ``"auto"`` takes the
namespace mode when this machine allows it, and the weak hook mode only when the caller opted
in to it):

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

``hook`` (weak fallback, any POSIX system; runs only when the caller opts in, see below)
  The code runs in a child process, in a session and process group of its own, under an
  audit hook (PEP 578) installed before the code runs (`metaloom.sandbox._audit.make_hook`).
  What it guarantees against code that uses Python's own means (the standard library, the
  os/signal/socket/subprocess functions, open, pathlib, shutil, tempfile, sqlite3):
  - no network: creating a socket is refused;
  - no new processes: fork, exec, spawn, subprocess, os.system, posix_spawn, and a
    subinterpreter (which would run without the hook) are refused;
  - the caller lives on: a signal may go only to the code's own process (``os.kill`` of its
    own pid, or of its own group, which holds nothing else); ``os.kill(os.getppid(), ...)``,
    ``os.kill(-1, ...)``, ``os.killpg`` of another group, ``signal.pidfd_send_signal`` and
    ``resource.prlimit`` on another process are refused; in its own session the code has no
    controlling terminal, and the ioctl that types into a terminal (TIOCSTI) is refused;
  - the file system stays as it was outside the working directory: opening for writing
    (``/dev/null`` excepted), creating, removing, renaming, hard-linking, chmod, chown, utime,
    truncate, extended attributes, FIFOs and device nodes are refused there, with paths
    resolved as the kernel would (``realpath``, ``dir_fd`` and descriptors through
    /proc/self/fd); symbolic links cannot be created at all, relative paths that climb with
    ``..`` cannot be opened, and directories outside cannot be opened (a directory
    descriptor would let relative paths escape);
  - no ready-made C escape hatch: importing ctypes or cffi (C calls the hook cannot see),
    the test C-API modules, dbm's C back ends, readline or POSIX shared memory raises
    ImportError; unaudited functions (os.mkfifo, os.mknod, pidfd_send_signal,
    _posixsubprocess.fork_exec) are wrapped so the hook sees them.
  A refusal is a PermissionError (ImportError for an import) raised in the code, so the run
  ends "failed" with the reason in ``failure`` unless the code catches it.
  What it does not guarantee: an audit hook lives in the interpreter it guards, so code
  written to defeat it can get around it — from C, in an installed extension module that
  acts without audit events; from Python, by altering what the hook relies on
  (monkeypatching os or os.path, reaching the hook or the original functions through
  introspection or importlib internals); or by racing the checks from a second thread.
  Not covered at all: reading (the code can read what the caller's user can), the CPU
  priority and affinity of the user's other processes (os.setpriority,
  os.sched_setaffinity), files opened by SQL ``ATTACH`` in sqlite3. On systems without
  /proc, operations on file descriptors (fchmod, ``dir_fd``) are refused.
  Hence the opt-in: ``network="auto"`` uses the hook mode only with ``allow_weak=True`` or
  ``METALOOM_SANDBOX_WEAK=1`` in the environment (for the CLI, and for code paths that use
  the default limits); ``network="hook"`` asks for it explicitly. Without either, running
  raises `SandboxUnavailable`, which says why namespaces are unavailable.

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


WEAK_ENV = "METALOOM_SANDBOX_WEAK"
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("", "0", "false", "no", "off")


class SandboxError(MetaloomError):
    """The sandbox could not isolate the code, so it did not run it."""


class SandboxUnavailable(SandboxError):
    """Only the weak ``hook`` mode is available here and the caller did not opt in to it; the
    code did not run. ``reason`` says why the namespace mode is unavailable."""

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(
            f"no strong sandbox here: the namespace mode is unavailable ({reason}). The only isolation "
            "left is the weak 'hook' mode, an audit hook inside the child process: it stops code that "
            "signals other processes, writes outside its folder, starts processes or opens sockets "
            "through Python's own means, but not code written to get around it (details: "
            "metaloom.sandbox.run). To run untrusted code with it anyway, opt in with "
            f"SandboxLimits(allow_weak=True) or SandboxLimits(network='hook'), or {WEAK_ENV}=1 in the "
            "environment (CLI); or enable user namespaces (e.g. sysctl kernel.unprivileged_userns_clone=1, "
            "kernel.apparmor_restrict_unprivileged_userns=0) or run where `unshare` is permitted.")


@dataclass(frozen=True)
class SandboxLimits:
    """How much one run may take. ``memory_mb`` is address space (RLIMIT_AS) per process;
    ``output_kb`` is how much of the end of stdout and of stderr is kept; ``file_mb`` caps
    each file the code writes (stdout and stderr included). ``network`` picks the isolation
    (see the module docstring); ``allow_weak=True`` lets ``"auto"`` fall back to the weak
    ``hook`` mode where namespaces are unavailable (else running raises `SandboxUnavailable`)."""

    timeout_s: float = 5.0
    memory_mb: int = 512
    file_mb: int = 16
    output_kb: int = 64
    network: str = "auto"
    allow_weak: bool = False

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
        if not isinstance(self.allow_weak, bool):
            raise InvalidParameter("allow_weak", self.allow_weak, "True or False")


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
def _namespace_probe() -> str | None:
    """``None`` when the ``namespace`` mode works here, else why not. An empty program is run
    in it, so that every step (namespaces, read-only remounts, dropping capabilities) is
    tried once."""
    if not sys.platform.startswith("linux"):
        return f"namespaces are Linux-only; this is {sys.platform}"
    if shutil.which("unshare") is None:
        return "`unshare` (util-linux) is not on PATH"
    try:
        result = _run("", "", SandboxLimits(timeout_s=20.0), "namespace")
    except (OSError, SandboxError) as exc:
        return f"`unshare {' '.join(_user_flags() + _UNSHARE_FLAGS)}` failed: {str(exc).strip()[-300:]}"
    if result.passed:
        return None
    detail = (result.stderr.strip() or result.failure).strip()[-300:]
    return f"`unshare {' '.join(_user_flags() + _UNSHARE_FLAGS)}` failed: {detail}"


def namespaces_available() -> bool:
    """Whether the ``namespace`` mode works here (probed once per process)."""
    return _namespace_probe() is None


def weak_opted_in() -> bool:
    """Whether ``METALOOM_SANDBOX_WEAK`` in the environment opts in to the weak ``hook`` mode."""
    value = os.environ.get(WEAK_ENV, "").strip().lower()
    if value not in _TRUE + _FALSE:
        raise InvalidParameter(WEAK_ENV, value, "1 (opt in to the weak hook mode) or 0")
    return value in _TRUE


def _user_flags() -> tuple[str, ...]:
    # without root, a user namespace (mapping us to root inside it) grants the rights to make
    # the others; as root it would only add a layer
    return () if os.geteuid() == 0 else ("--user", "--map-root-user")


def resolve_mode(network: str, *, allow_weak: bool = False) -> str:
    """The isolation mode ``network`` means on this machine. ``"auto"`` without namespaces
    gives ``"hook"`` only when the caller opted in (``allow_weak`` or ``METALOOM_SANDBOX_WEAK=1``),
    else raises `SandboxUnavailable`; ``"hook"`` is itself the opt-in."""
    if network == "hook":
        return "hook"
    if namespaces_available():
        return "namespace"
    if network == "namespace":
        raise InvalidParameter("network", network, "'auto' or 'hook' here: `unshare --net --pid --mount` is not permitted")
    if allow_weak or weak_opted_in():
        return "hook"
    raise SandboxUnavailable(_namespace_probe() or "the namespace probe failed")


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
    `SandboxError` when isolation could not be set up (the code did not run), in particular
    `SandboxUnavailable` when only the weak mode is available and the caller did not opt in."""
    limits = limits or SandboxLimits()
    return _run(code, stdin, limits, resolve_mode(limits.network, allow_weak=limits.allow_weak))


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

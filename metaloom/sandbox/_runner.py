"""The program the sandbox starts: it isolates itself, then runs the untrusted code.

Run as ``python -I -B -u _runner.py CONFIG.json``. Standard library only, and nothing from
metaloom: it must start fast and must not import the caller's heavy dependencies.

Two modes (``config["mode"]``), chosen by the caller (`metaloom.sandbox.run`):

``namespace`` — started under ``unshare --net --pid --mount --mount-proc --fork --kill-child``,
so this process is PID 1 of fresh network, PID and mount namespaces. As PID 1 it:
  1. bind-mounts the work directory onto itself, remounts every other mount read-only and
     mounts a private, size-capped tmpfs on /dev/shm (the only writable places);
  2. forks the child that runs the code and waits for it; when it returns, the namespace's
     init is gone and the kernel kills every process left in the namespace, so nothing the
     code started outlives the run. PID 1 itself never runs user code: the kernel drops
     signals sent to a namespace's init, which would change the code's behaviour.
The child sets resource limits, drops every capability (bounding set too) and sets
no_new_privs, so it cannot remount, cannot raise its limits and cannot regain privileges
through a set-uid program; the network namespace has no interface but a down loopback.

``hook`` — no namespaces (the caller opted in to this weak mode): the code runs in this
process, in a session of its own, after an audit hook (PEP 578, `_audit.make_hook`) that refuses:
  - sockets and new processes (fork, exec, spawn, subprocess, os.system, a subinterpreter);
  - signals to any process but this one (os.kill, os.killpg, signal.pidfd_send_signal) and
    resource.prlimit on another process;
  - changes to files outside the working directory: opening for writing (``/dev/null``
    excepted), creating, removing, renaming, linking, chmod/chown/utime/truncate, extended
    attributes, FIFOs and device nodes. Paths are resolved as the kernel would (``realpath``,
    ``dir_fd`` and file descriptors through /proc/self/fd); symbolic links cannot be created
    at all, so every path inside the working directory is what it looks like; a relative path
    that climbs with ``..`` cannot be opened (with ``dir_fd`` it could start from any
    directory); and no directory outside can be opened (its descriptor would be a ``dir_fd``);
  - modules that reach C without audit events (ctypes, cffi, the test C-API modules, dbm's C
    back ends, readline) and POSIX shared memory: importing them raises ImportError, so
    optional uses (numpy's ctypes helpers, dbm) fall back as they would without them.
Functions that act without raising an audit event in Python 3.11 (os.mkfifo, os.mknod,
signal.pidfd_send_signal, _posixsubprocess.fork_exec) are first replaced by wrappers that
raise one. Best effort against code that does these things directly — by mistake or
naively; not against code written to get around the hook (see `metaloom.sandbox.run`).

Exit codes the caller reads: the code's own exit status; ``EXIT_MEMORY`` when a MemoryError
ends it; ``EXIT_SETUP`` when isolation could not be set up (the code did not run); and, in
namespace mode, ``128 + signal`` when the child died of a signal.
"""

from __future__ import annotations

import json
import os
import resource
import sys

TYPE_CHECKING = False
if TYPE_CHECKING:  # at run time ctypes is imported by the namespace mode only: hook mode refuses it
    import ctypes

EXIT_MEMORY = 97
EXIT_SETUP = 98
FILENAME = "<sandbox>"

# Linux constants (sys/mount.h, sys/prctl.h, linux/capability.h)
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC, _MS_REMOUNT, _MS_BIND = 1, 2, 4, 8, 32, 4096
_MS_NOATIME, _MS_NODIRATIME, _MS_RELATIME = 1024, 2048, 1 << 21
_MOUNT_FLAGS = {"nosuid": _MS_NOSUID, "nodev": _MS_NODEV, "noexec": _MS_NOEXEC,
                "noatime": _MS_NOATIME, "nodiratime": _MS_NODIRATIME, "relatime": _MS_RELATIME}
_PR_CAPBSET_DROP, _PR_SET_NO_NEW_PRIVS = 24, 38
_CAP_VERSION_3 = 0x20080522


class SetupError(Exception):
    """Isolation could not be set up; the code must not run."""


def _libc() -> ctypes.CDLL:
    import ctypes

    return ctypes.CDLL(None, use_errno=True)


def _check(rc: int, what: str) -> None:
    import ctypes

    if rc != 0:
        raise SetupError(f"{what}: {os.strerror(ctypes.get_errno())}")


def _unescape(path: str) -> str:
    # mountinfo escapes space, tab, newline and backslash as octal (\040 ...)
    return path.encode().decode("unicode_escape").encode("latin-1").decode()


def _mounts() -> list[tuple[str, int]]:
    """(mount point, per-mount flags to keep) for every mount, from /proc/self/mountinfo."""
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            keep = 0
            for opt in fields[5].split(","):
                keep |= _MOUNT_FLAGS.get(opt, 0)
            out.append((_unescape(fields[4]), keep))
    return out


def make_readonly_except(workdir: str, shm_bytes: int) -> None:
    """Everything read-only but ``workdir`` and a fresh /dev/shm (in our own mount namespace
    only). The private /dev/shm, ``shm_bytes`` large, lets multiprocessing's locks work and
    vanishes with the namespace."""
    import ctypes

    libc = _libc()
    libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_void_p]
    # a bind mount of the work directory onto itself gets its own per-mount flags, so it stays
    # writable when the filesystem it lives on is made read-only below
    _check(libc.mount(workdir.encode(), workdir.encode(), None, _MS_BIND, None), "bind work directory")
    for point, keep in _mounts():
        if point == workdir:
            continue
        rc = libc.mount(None, point.encode(), None, _MS_REMOUNT | _MS_BIND | _MS_RDONLY | keep, None)
        _check(rc, f"remount {point} read-only")
    if os.path.isdir("/dev/shm"):
        options = f"size={shm_bytes},mode=1777".encode()
        rc = libc.mount(b"tmpfs", b"/dev/shm", b"tmpfs", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC, options)
        _check(rc, "mount a private /dev/shm")


def drop_privileges() -> None:
    """No capabilities now or after any exec, and no way to gain them (no_new_privs)."""
    import ctypes

    libc = _libc()
    with open("/proc/sys/kernel/cap_last_cap") as f:
        last = int(f.read())
    for cap in range(last + 1):  # needs CAP_SETPCAP, so before clearing the effective set
        _check(libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0), f"drop capability {cap} from bounding set")
    _check(libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "set no_new_privs")

    class Header(ctypes.Structure):
        _fields_ = (("version", ctypes.c_uint32), ("pid", ctypes.c_int))

    class Data(ctypes.Structure):
        _fields_ = (("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32))

    data = (Data * 2)()  # all zero: version 3 sets describe 64 capabilities in two words
    _check(libc.capset(ctypes.byref(Header(_CAP_VERSION_3, 0)), data), "clear capabilities")


def set_limits(cfg: dict) -> None:
    """Soft = hard, so the code cannot raise them back."""
    memory = cfg["memory_bytes"]
    for limit, value in ((resource.RLIMIT_AS, memory), (resource.RLIMIT_DATA, memory),
                         (resource.RLIMIT_CPU, cfg["cpu_seconds"]), (resource.RLIMIT_FSIZE, cfg["file_bytes"]),
                         (resource.RLIMIT_CORE, 0)):
        resource.setrlimit(limit, (value, value))


# --- hook mode ------------------------------------------------------------------------------

def install_hook(workdir: str) -> None:
    """Hook mode: the audit hook of ``_audit.py`` (beside this file) installed, after the
    functions that act unaudited are wrapped; it cannot be removed. The file is loaded by its
    path: ``python -I`` puts no script directory on ``sys.path``, and importing it as
    ``metaloom.sandbox._audit`` would import the package."""
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_audit.py")
    try:
        spec = importlib.util.spec_from_file_location("_metaloom_sandbox_audit", path)
        if spec is None or spec.loader is None:
            raise ImportError(f"no loader for {path}")
        audit = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(audit)
    except (OSError, ImportError, SyntaxError) as exc:
        raise SetupError(f"audit hook: {exc}") from exc
    audit.install_hook(workdir)


def execute(source: str) -> None:
    """Run ``source`` as the ``__main__`` module and exit as a Python program would."""
    import linecache
    import traceback
    import types

    # tracebacks show the failing source line (e.g. the assert) although no file holds it
    linecache.cache[FILENAME] = (len(source), None, source.splitlines(True), FILENAME)
    module = types.ModuleType("__main__")
    module.__dict__["__builtins__"] = __builtins__
    sys.modules["__main__"] = module
    sys.argv = [FILENAME]
    try:
        exec(compile(source, FILENAME, "exec"), module.__dict__)
    except MemoryError:
        os.write(2, b"MemoryError: the sandbox's memory limit was reached\n")
        os._exit(EXIT_MEMORY)
    except SystemExit:
        raise
    except BaseException as exc:  # the program's own failure: print it as Python would, without our frame
        traceback.print_exception(type(exc), exc, exc.__traceback__.tb_next if exc.__traceback__ else None)
        sys.exit(1)
    sys.exit(0)


def _run_child(cfg: dict, source: str) -> None:
    try:
        os.chdir(cfg["workdir"])
        set_limits(cfg)
    except (OSError, ValueError) as exc:
        raise SetupError(f"limits: {exc}") from exc
    if cfg["mode"] == "namespace":
        drop_privileges()
    else:
        install_hook(cfg["workdir"])
    execute(source)


def _wait_for(child: int) -> int:
    """Reap every process (PID 1 inherits orphans) until ``child`` ends; its exit code, or
    ``128 + signal``."""
    while True:
        pid, status = os.wait()
        if pid == child:
            return os.WEXITSTATUS(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status)


def main(config_path: str) -> None:
    with open(config_path) as f:
        cfg = json.load(f)
    with open(cfg["source_path"]) as f:
        source = f.read()
    try:
        if cfg["mode"] == "namespace":
            if os.getpid() != 1:
                raise SetupError("namespace mode must run as PID 1 of a new PID namespace")
            make_readonly_except(cfg["workdir"], cfg["memory_bytes"])
            child = os.fork()
            if child == 0:
                try:
                    _run_child(cfg, source)
                except SetupError as exc:
                    os.write(2, f"sandbox setup failed: {exc}\n".encode())
                    os._exit(EXIT_SETUP)
            os._exit(_wait_for(child))
        _run_child(cfg, source)
    except SetupError as exc:
        os.write(2, f"sandbox setup failed: {exc}\n".encode())
        os._exit(EXIT_SETUP)


if __name__ == "__main__":
    main(sys.argv[1])

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
process, in a session of its own, after an audit hook (PEP 578, `make_hook`) that refuses:
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
    from collections.abc import Callable

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

_PROCESS_EVENTS = frozenset({
    "socket.__new__", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty",
    "subprocess.Popen", "_posixsubprocess.fork_exec",
})
_C_LEVEL = "it calls C code that the audit hook cannot see"
_DENIED_IMPORTS = {
    "ctypes": _C_LEVEL, "_ctypes": _C_LEVEL, "_cffi_backend": _C_LEVEL,
    "_testcapi": _C_LEVEL, "_testinternalcapi": _C_LEVEL,
    "_dbm": "it writes files that the audit hook cannot see (dbm falls back to dbm.dumb)",
    "_gdbm": "it writes files that the audit hook cannot see (dbm falls back to dbm.dumb)",
    "readline": "it writes history files that the audit hook cannot see",
    "_posixshmem": "shared memory lives outside the working directory",
    "_xxsubinterpreters": "a subinterpreter runs without the audit hook",
    # fresh copies would bring back the functions `_wrap_unaudited` replaced
    "posix": "the sandbox wrapped some of its functions",
    "_signal": "the sandbox wrapped some of its functions",
    "_posixsubprocess": "the sandbox wrapped some of its functions",
}
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
_DIRECTORY_FLAGS = os.O_DIRECTORY | getattr(os, "O_PATH", 0)  # such a descriptor can serve as a dir_fd
_TIOCSTI = 0x5412  # Linux: push characters into a terminal's input
# events that change a file: the (path, dir_fd) argument positions of each file they touch
# (None: no dir_fd); a path may also be an open file descriptor
_FILE_EVENTS: dict[str, tuple[tuple[int, int | None], ...]] = {
    "os.mkdir": ((0, 2),), "os.rmdir": ((0, 1),), "os.remove": ((0, 1),),
    "os.rename": ((0, 2), (1, 3)), "os.link": ((0, 2), (1, 3)),
    "os.chmod": ((0, 2),), "os.chown": ((0, 3),), "os.utime": ((0, 3),), "os.truncate": ((0, None),),
    "os.setxattr": ((0, None),), "os.removexattr": ((0, None),), "os.chflags": ((0, None),),
    "os.mkfifo": ((0, 2),), "os.mknod": ((0, 3),),  # raised by our wrappers (`_wrap_unaudited`)
}


def _refuse(what: str, why: str) -> PermissionError:
    return PermissionError(f"sandbox: {what} is not allowed ({why})")


def _wrap_unaudited() -> None:
    """Functions that change files or reach other processes without an audit event (Python
    3.11) are replaced, in every module that holds them, by ones that raise an event first
    (the hook then decides) or, where the hook would always refuse, that only raise it."""
    import _posixsubprocess
    import _signal
    import posix
    import signal

    mkfifo, mknod = posix.mkfifo, posix.mknod

    def audited_mkfifo(path, mode=0o666, *, dir_fd=None):
        sys.audit("os.mkfifo", os.fspath(path), mode, -1 if dir_fd is None else dir_fd)
        return mkfifo(path, mode, dir_fd=dir_fd)

    def audited_mknod(path, mode=0o600, device=0, *, dir_fd=None):
        sys.audit("os.mknod", os.fspath(path), mode, device, -1 if dir_fd is None else dir_fd)
        return mknod(path, mode, device, dir_fd=dir_fd)

    def refused_pidfd_send_signal(pidfd, sig, siginfo=None, flags=0):
        sys.audit("signal.pidfd_send_signal", pidfd, sig)
        raise _refuse("signal.pidfd_send_signal", "signals only to the program itself")

    def refused_fork_exec(*args):
        sys.audit("_posixsubprocess.fork_exec")
        raise _refuse("_posixsubprocess.fork_exec", "no network, no new processes")

    replacements = ((os, "mkfifo", audited_mkfifo), (posix, "mkfifo", audited_mkfifo),
                    (os, "mknod", audited_mknod), (posix, "mknod", audited_mknod),
                    (signal, "pidfd_send_signal", refused_pidfd_send_signal),
                    (_signal, "pidfd_send_signal", refused_pidfd_send_signal),
                    (_posixsubprocess, "fork_exec", refused_fork_exec))
    for module, name, replacement in replacements:
        if hasattr(module, name):  # pidfd_send_signal: Linux only
            setattr(module, name, replacement)


def make_hook(workdir: str) -> Callable[[str, tuple], None]:
    """The audit hook of the hook mode: raises PermissionError (ImportError for an import)
    for what the program may not do (see the module docstring), in the program's own call."""
    root = os.path.realpath(workdir)
    me = os.getpid()
    realpath, join, split, isabs, isdir, normpath = (os.path.realpath, os.path.join, os.path.split,
                                                     os.path.isabs, os.path.isdir, os.path.normpath)

    def inside(path: str | None) -> bool:
        return path is not None and (path == root or path.startswith(root + os.sep))

    def fd_path(fd: int) -> str | None:
        try:
            return os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # not an open descriptor, or no /proc: counts as outside
            return None

    def reached(path: object, dir_fd: object) -> str | None:
        """The real path an operation on ``path`` (relative to ``dir_fd``) reaches; the last
        component is not followed (no symbolic link can exist inside the working directory,
        and one outside leaves its directory outside)."""
        if isinstance(path, int):
            return fd_path(path)
        name = os.fsdecode(os.fspath(path))  # type: ignore[call-overload]
        if not isabs(name):
            base = fd_path(dir_fd) if isinstance(dir_fd, int) and dir_fd >= 0 else os.getcwd()
            if base is None:
                return None
            name = join(base, name)
        head, tail = split(name)
        return realpath(name) if tail in ("", ".", "..") else join(realpath(head), tail)

    def outside(what: str) -> PermissionError:
        return _refuse(what, f"hook mode: files may change only inside {root}")

    def check_open(args: tuple) -> None:
        path, mode, flags = args
        if isinstance(path, int) or path is None:  # an open descriptor: it was checked when opened
            return
        name = os.fsdecode(os.fspath(path))
        if not isabs(name) and normpath(name).split(os.sep)[0] == "..":
            raise _refuse(f"opening {name!r}", "hook mode: a relative path may not climb out with '..'; "
                                               "use an absolute path")
        real = realpath(name)
        if isinstance(flags, int):
            writes, directory = flags & _WRITE_FLAGS, flags & _DIRECTORY_FLAGS
        else:
            writes, directory = any(c in (mode or "") for c in "wax+"), 0
        if writes:
            if not (inside(real) or real == os.devnull):
                raise outside(f"opening {name!r} for writing")
        elif (directory or isdir(real)) and not inside(real):
            raise _refuse(f"opening the directory {name!r}", "hook mode: its descriptor would let relative "
                                                             "paths reach outside the working directory")

    def check_files(event: str, args: tuple) -> None:
        for path_at, dir_fd_at in _FILE_EVENTS[event]:
            dir_fd = args[dir_fd_at] if dir_fd_at is not None and dir_fd_at < len(args) else -1
            if not inside(reached(args[path_at], dir_fd)):
                raise outside(f"{event} of {args[path_at]!r}")

    def check_signal(event: str, args: tuple) -> None:
        target = args[0]
        own_group = os.getpgid(0) == me  # we lead our group (own session) and cannot fork
        if event == "os.kill" and (target == me or (target in (0, -me) and own_group)):
            return
        if event == "os.killpg" and target in (0, me) and own_group:
            return
        raise _refuse(f"{event} to {target}", "hook mode: signals only to the program itself")

    def check_import(name: object) -> None:
        top = str(name).partition(".")[0]
        if top in _DENIED_IMPORTS:
            raise ImportError(f"sandbox: importing {name} is not allowed (hook mode: {_DENIED_IMPORTS[top]})",
                              name=str(name))

    def hook(event: str, args: tuple) -> None:
        if event == "open":
            check_open(args)
        elif event in _FILE_EVENTS:
            check_files(event, args)
        elif event == "import":
            check_import(args[0])
        elif event in _PROCESS_EVENTS:
            raise _refuse(event, "no network, no new processes")
        elif event in ("os.kill", "os.killpg"):
            check_signal(event, args)
        elif event == "signal.pidfd_send_signal":
            raise _refuse(event, "hook mode: signals only to the program itself")
        elif event == "resource.prlimit" and args[2] is not None and args[0] not in (0, me):
            raise _refuse(f"resource.prlimit on process {args[0]}", "hook mode: only the program's own limits")
        elif event == "os.symlink":
            raise _refuse(event, "hook mode: a link could lead outside the working directory")
        elif event == "sqlite3.connect":
            database = os.fsdecode(os.fspath(args[0]))
            if database.startswith("file:"):
                raise _refuse(f"sqlite3 URI {database!r}", "hook mode: give a plain path")
            if database not in ("", ":memory:") and not inside(reached(database, -1)):
                raise outside(f"{event} of {database!r}")
        elif event in ("ctypes.dlopen", "ctypes.dlsym", "ctypes.dlsym/handle", "cpython.PyInterpreterState_New"):
            raise _refuse(event, "hook mode: C code and subinterpreters run unseen by the audit hook")
        elif event == "fcntl.ioctl" and args[1] == _TIOCSTI:
            raise _refuse("ioctl TIOCSTI", "hook mode: no typing into a terminal")

    return hook


def install_hook(workdir: str) -> None:
    """Hook mode: wrap the unaudited functions, then add the audit hook (it cannot be removed)."""
    _wrap_unaudited()
    sys.addaudithook(make_hook(workdir))


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

"""The sandbox's hook mode (`metaloom.sandbox._runner` installs it when the caller opted in to
it): an audit hook (PEP 578) that refuses, in the program's own call, what the program may not
do — sockets and new processes, signals to other processes, changes to files outside the
working directory, modules that reach C unseen — after the functions that act without an audit
event are wrapped so that they raise one (see `_runner`'s docstring for the full list).

Standard library only, and nothing from metaloom: the runner loads this file by its path
(``python -I`` puts no script directory on ``sys.path``), before the untrusted code runs.
"""

from __future__ import annotations

import os
import sys

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable

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

def install_hook(workdir: str) -> None:
    """Wrap the unaudited functions, then add the audit hook (it cannot be removed)."""
    _wrap_unaudited()
    sys.addaudithook(make_hook(workdir))


def make_hook(workdir: str) -> Callable[[str, tuple], None]:
    """The audit hook of the hook mode: raises PermissionError (ImportError for an import)
    for what the program may not do (see the module docstring), in the program's own call."""
    me = os.getpid()
    check_open, check_files, check_database = _file_checks(os.path.realpath(workdir))

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
            check_database(args[0])
        elif event in ("ctypes.dlopen", "ctypes.dlsym", "ctypes.dlsym/handle", "cpython.PyInterpreterState_New"):
            raise _refuse(event, "hook mode: C code and subinterpreters run unseen by the audit hook")
        elif event == "fcntl.ioctl" and args[1] == _TIOCSTI:
            raise _refuse("ioctl TIOCSTI", "hook mode: no typing into a terminal")

    return hook


def _file_checks(root: str) -> tuple[Callable[[tuple], None], Callable[[str, tuple], None], Callable[[object], None]]:
    """The hook's checks of what a file operation reaches, each raising PermissionError for a
    change outside ``root``: ``check_open`` (the "open" event's arguments), ``check_files`` (an
    event of `_FILE_EVENTS` and its arguments) and ``check_database`` (sqlite3.connect's
    database). The os.path functions are bound here, once, before the program runs."""
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

    def check_database(path: object) -> None:
        database = os.fsdecode(os.fspath(path))  # type: ignore[call-overload]
        if database.startswith("file:"):
            raise _refuse(f"sqlite3 URI {database!r}", "hook mode: give a plain path")
        if database not in ("", ":memory:") and not inside(reached(database, -1)):
            raise outside(f"sqlite3.connect of {database!r}")

    return check_open, check_files, check_database

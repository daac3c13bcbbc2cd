"""One writer per sweep folder: `metaloom eval` holds an exclusive lock on ``DIR/.lock`` while it
runs, so a second run into the same ``--out`` stops at once and says who holds it, instead of
both running every pair (they did: 6 records for 3 pairs).

The lock is ``flock`` on the file, so it dies with its process (no stale lock after a crash);
the file holds the holder's pid, host and start time for the message, and the strategies it is
running (`metaloom.eval.status` reads them: a folder's config lists every strategy any run of it
asked for, the lock what the running one will do).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from collections.abc import Iterator, Sequence

from metaloom.errors import MetaloomError

LOCK = ".lock"


class SweepLocked(MetaloomError):
    """Another `metaloom eval` is writing this sweep folder."""


@contextlib.contextmanager
def sweep_lock(out: str, strategies: Sequence[str] = ()) -> Iterator[None]:
    """Hold ``out``'s lock for the block (creating ``out``); a `SweepLocked` naming the holder
    when another process holds it. ``strategies``: what this run will run, for the status."""
    try:
        import fcntl
    except ImportError:  # no flock on this platform: nothing to hold
        yield
        return
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, LOCK)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise SweepLocked(f"{out} is being written by another metaloom eval ({_holder(path)}): wait for it "
                              "to finish, or give another --out") from None
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                 "since": time.strftime("%Y-%m-%d %H:%M:%S"), "strategies": list(strategies)}).encode())
        yield
    finally:
        os.close(fd)  # releases the lock


def _holder(path: str) -> str:
    try:
        with open(path) as f:
            h = json.load(f)
        return f"pid {h['pid']} on {h['host']}, since {h['since']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "holder unknown"

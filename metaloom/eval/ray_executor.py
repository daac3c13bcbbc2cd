"""Ray fan-out for `metaloom eval` (``--executor ray [--ray-address auto]``).

`make_ray_executor` returns an `Executor` for `run_sweep`: the sweep's jobs go to a pool of
Ray actors, one per worker, fed and watched by the driver's loop (`metaloom.eval.ray_fanout`,
which says why actors, why a worker keeps to one problem, and what happens when a worker dies
or raises). Here: the address, the cluster and how many workers with how many threads.

An address that does not answer is `InvalidParameter("ray_address", ...)` within
``connect_timeout`` seconds, raised by `make_ray_executor` itself, before the sweep writes
anything: the address is probed (a TCP connection and the HTTP/2 greeting every gRPC server,
Ray's GCS and its client server included, answers) before ``ray.init`` is called, because
``ray.init`` retries an unanswering GCS for minutes.

Clusters: ``address=None`` starts a local one (all of this machine's CPUs, at least one per
worker; no dashboard, worker logs not forwarded) and shuts it down when the sweep's jobs are
done; ``"auto"``, ``host:port`` or ``ray://host:port`` connects and leaves the cluster as
it was (its actors are killed). A process that already called ``ray.init`` keeps its cluster.
A remote cluster's workers must be able to import metaloom (and any ``Setup.factory``).

Threads: unless the `Setup` says, a worker that loads a model sets torch's thread count so the
workers of one machine together use its CPUs (on a one-node cluster: its CPUs // workers; on
several nodes: ``num_cpus_per_worker``, what Ray reserves for each).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import socket
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from metaloom.errors import InvalidParameter
from metaloom.eval.ray_fanout import Fanout, WorkerFailed
from metaloom.eval.worker import Job, Outcome, Setup

DEFAULT_CONNECT_TIMEOUT = 10.0
_HTTP2_GREETING = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])  # preface + SETTINGS
_SETTINGS_FRAME = 4


# ----------------------------------------------------------------------------------- address


def _host_port(address: str) -> tuple[str, int]:
    """``host:port`` (or ``[v6]:port``) as a pair; `InvalidParameter` for anything else."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise InvalidParameter("ray_address", address, "auto, host:port or ray://host:port")
    return host.strip("[]"), int(port)


def _resolve(address: str) -> tuple[str, int]:
    """Where ``ray.init(address)`` will connect: ``auto`` is the running cluster Ray finds
    (RAY_ADDRESS, then the last ``ray start`` on this machine), ``host:port`` as Ray
    canonicalises it (localhost becomes this node's address), ``ray://`` as given."""
    if address == "auto" and os.environ.get("RAY_ADDRESS"):
        address = os.environ["RAY_ADDRESS"]  # as Ray reads it (it may be a ray:// address)
    if address.startswith("ray://"):
        return _host_port(address[len("ray://"):])
    if address != "auto":
        _host_port(address)
    from ray._private.services import canonicalize_bootstrap_address

    try:
        resolved = canonicalize_bootstrap_address(address)
    except (ConnectionError, ValueError, OSError) as exc:
        raise InvalidParameter("ray_address", address, f"the address of a running Ray cluster ({exc})") from exc
    if resolved is None:
        raise InvalidParameter("ray_address", address, "the address of a running Ray cluster (none found)")
    return _host_port(resolved)


def probe(address: str, timeout: float) -> None:
    """Check within ``timeout`` seconds that a gRPC server answers at ``address`` (Ray's GCS,
    or its client server for ``ray://``): `InvalidParameter` when nothing does."""
    host, port = _resolve(address)
    why = None
    try:
        with socket.create_connection((host, port), timeout=timeout) as conn:
            conn.settimeout(timeout)
            conn.sendall(_HTTP2_GREETING)
            header = conn.recv(9)
            if len(header) < 9 or header[3] != _SETTINGS_FRAME:
                why = "it answered, but not as a gRPC server"
    except OSError as exc:  # refused, unreachable, timed out
        why = f"no answer within {timeout:g}s: {exc}"
    if why is not None:
        # the address as given first: Ray canonicalises localhost to this node's own address
        reached = f"{host}:{port}"
        where = address if reached in (address, address.removeprefix("ray://")) else f"{address}, reached as {reached}"
        raise InvalidParameter("ray_address", address, f"the address of a running Ray cluster ({where}: {why})")


# ----------------------------------------------------------------------------------- cluster


def _machine_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


@contextmanager
def cluster(address: str | None, workers: int | None, num_cpus_per_worker: float) -> Iterator[None]:
    """Ray, connected for the block: a cluster this started is shut down after it, one it
    connected to is left running, one this process had already joined is kept."""
    import ray

    if ray.is_initialized():
        yield
        return
    quiet: dict[str, Any] = {"include_dashboard": False, "log_to_driver": False, "logging_level": logging.ERROR}
    if address is None:
        cpus = max(_machine_cpus(), math.ceil((workers or 1) * num_cpus_per_worker))
        try:
            ray.init(address="local", num_cpus=cpus, **quiet)  # "local": a new cluster, whatever RAY_ADDRESS says
        except (ConnectionError, TimeoutError, RuntimeError) as exc:
            raise WorkerFailed(f"could not start a local Ray cluster: {type(exc).__name__}: {exc}") from exc
    else:
        quiet.pop("include_dashboard")
        try:
            ray.init(address=address, **quiet)
        except (ConnectionError, TimeoutError, RuntimeError) as exc:
            raise InvalidParameter("ray_address", address, f"a Ray cluster ray.init can join ({exc})") from exc
    try:
        yield
    finally:
        ray.shutdown()


def loads_model(setup: Setup) -> bool:
    """Whether the workers load a model in-process (so torch's thread count matters). A
    remote endpoint's does not; a factory's generator is the caller's, and Ray's
    ``OMP_NUM_THREADS`` (the worker's CPU reservation) bounds a torch one."""
    return setup.factory is None and setup.backend != "openai"


def _plan(workers: int | None, num_cpus_per_worker: float, setup: Setup) -> tuple[int, Setup]:
    """How many workers (default: as many as the cluster has room for) and each one's setup
    (its thread count filled in, see the module docstring)."""
    import ray

    total = float(ray.cluster_resources().get("CPU", 0))
    if num_cpus_per_worker > total:
        raise InvalidParameter("num_cpus_per_worker", num_cpus_per_worker,
                               f"at most the cluster's {total:g} CPUs (a worker would never start)")
    n = workers if workers is not None else max(1, int(total // num_cpus_per_worker))
    if setup.threads is None and loads_model(setup):
        nodes = [node for node in ray.nodes() if node.get("Alive")]
        per = total // n if len(nodes) == 1 else num_cpus_per_worker
        setup = dataclasses.replace(setup, threads=max(1, int(per)))
    return n, setup


# ----------------------------------------------------------------------------------- executor


@dataclass(frozen=True)
class RayExecutor:
    """An `Executor` (see `make_ray_executor`)."""

    address: str | None = None
    workers: int | None = None
    num_cpus_per_worker: float = 1
    max_retries: int = 3

    def __call__(self, setup: Setup, jobs: Sequence[Job], emit: Callable[[Outcome], None]) -> None:
        if not jobs:
            return
        with cluster(self.address, self.workers, self.num_cpus_per_worker):
            n, setup = _plan(self.workers, self.num_cpus_per_worker, setup)
            Fanout(setup, n, self.num_cpus_per_worker, self.max_retries).run(jobs, emit)


def _check(name: str, value: Any, ok: bool, allowed: str) -> None:
    if not ok:
        raise InvalidParameter(name, value, allowed)


def make_ray_executor(*, address: str | None = None, workers: int | None = None, num_cpus_per_worker: float = 1,
                      max_retries: int = 3, connect_timeout: float = DEFAULT_CONNECT_TIMEOUT) -> RayExecutor:
    """An executor that runs a sweep's jobs on Ray (see the module docstring). ``address``:
    None starts a local cluster; ``"auto"``, ``host:port`` or ``ray://host:port`` joins one,
    which must answer within ``connect_timeout`` seconds (checked now, so a bad address fails
    before the sweep writes anything). ``workers``: actors (default: the cluster's CPUs //
    ``num_cpus_per_worker``); ``max_retries``: how often a job whose worker died is run again."""
    _check("workers", workers, workers is None or (isinstance(workers, int) and not isinstance(workers, bool)
                                                   and workers >= 1), "an integer >= 1, or None")
    _check("num_cpus_per_worker", num_cpus_per_worker,
           isinstance(num_cpus_per_worker, int | float) and num_cpus_per_worker > 0, "a number > 0")
    _check("max_retries", max_retries, isinstance(max_retries, int) and max_retries >= 0, "an integer >= 0")
    _check("connect_timeout", connect_timeout, isinstance(connect_timeout, int | float) and connect_timeout > 0,
           "a number of seconds > 0")
    if address is not None:
        _check("ray_address", address, isinstance(address, str) and bool(address.strip()),
               "auto, host:port or ray://host:port")
        probe(address, connect_timeout)
    return RayExecutor(address, workers, num_cpus_per_worker, max_retries)

"""Ray fan-out of `metaloom eval` on a local two-CPU cluster: the same records as the local
executor, a killed worker's job retried with every record exactly once, typed errors for a
worker that cannot be built and for an address that does not answer, results emitted as
they finish. Workers run the scripted `eval_fixtures.arithmetic` generator (no model)."""

from __future__ import annotations

import json
import logging
import socket
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from metaloom.errors import InvalidParameter, ModelNotFound  # noqa: E402
from metaloom.eval.ray_executor import make_ray_executor, probe  # noqa: E402
from metaloom.eval.ray_fanout import WorkerFailed, WorkerLost, next_job  # noqa: E402
from metaloom.eval.records import RECORDS  # noqa: E402
from metaloom.eval.runner import plan_sweep, run_sweep  # noqa: E402
from metaloom.eval.worker import Job, Outcome, Setup  # noqa: E402
from metaloom.testing.eval_fixtures import problems_file  # noqa: E402

FACTORY = "metaloom.testing.eval_fixtures:arithmetic"
SPECS = ("greedy", "majority_vote@n=3")
SUMS = [(2, 3), (4, 4), (10, 7), (6, 9), (1, 1), (12, 30)]


@pytest.fixture(scope="module")
def cluster():
    """One local cluster for the module (the executor keeps a cluster it did not start)."""
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level=logging.ERROR)
    yield
    ray.shutdown()


def _task(tmp_path: Path, hooks: dict[int, str] | None = None) -> str:
    """The `SUMS` problems as a jsonl task; ``hooks[i]`` is appended to problem i's prompt."""
    hooks = hooks or {}
    return problems_file(str(tmp_path / "problems.jsonl"),
                         [(f"What is {a}+{b}? {hooks.get(i, '')}".strip(), str(a + b)) for i, (a, b) in enumerate(SUMS)])


def _sweep(task: str, out: Path, factory: str = FACTORY, specs: tuple[str, ...] = SPECS):
    return plan_sweep(Setup(task=task, factory=factory), specs, str(out))


def _lines(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / RECORDS).read_text().splitlines()]


def _essence(records) -> dict:
    return {r.key: (r.answer, r.correct, r.best, dict(r.usage), r.error) for r in records}


def test_ray_sweep_gives_the_local_executors_records(cluster, tmp_path):
    task = _task(tmp_path)
    local = run_sweep(_sweep(task, tmp_path / "local"))
    remote = run_sweep(_sweep(task, tmp_path / "ray"), executor=make_ray_executor(workers=2))
    assert _essence(remote) == _essence(local)
    assert len(remote) == len(SUMS) * len(SPECS) and all(r.correct for r in remote)
    lines = _lines(tmp_path / "ray")
    assert len({(d["problem"], d["strategy"]) for d in lines}) == len(lines) == len(SUMS) * len(SPECS)
    assert ray.is_initialized()  # a cluster the executor did not start is left running


def test_a_problems_strategies_stay_on_one_worker_so_its_sample_pool_is_drawn_once(cluster, tmp_path):
    """Majority vote and best-of-N at the same N replay one draw (`metaloom.eval.replay`), which
    a worker holds for the problem it ran last: with two workers, each problem's pool must still
    reach the generator once, not once per worker its strategies were sent to. Problem 0 waits
    until a first outcome is emitted, so the other worker surely takes jobs meanwhile."""
    log, flag = tmp_path / "draws.log", tmp_path / "first-emitted"
    hooks = {i: f"log-draws:{log}" for i in range(len(SUMS))}
    hooks[0] += f" wait-for:{flag}"
    specs = ("majority_vote@n=3", "best_of_n@n=3,scorer=logprob")
    sweep = _sweep(_task(tmp_path, hooks), tmp_path / "out", specs=specs)
    seen: list[Outcome] = []

    def emit(outcome: Outcome) -> None:
        seen.append(outcome)
        flag.touch()

    make_ray_executor(workers=2)(sweep.setup, [Job(i, s) for i in range(len(SUMS)) for s in specs], emit)
    assert len(seen) == len(SUMS) * len(specs) and all(o.record.correct for o in seen)  # problem 0 did not time out
    draws = [line.split(" ", 1) for line in log.read_text().splitlines()]
    prompts = [prompt for _pid, prompt in draws]
    assert len(prompts) == len(set(prompts)) == len(SUMS)  # each problem drawn once
    assert len({pid for pid, _ in draws}) == 2  # by both workers


def test_a_free_worker_takes_its_own_problem_then_a_problem_no_one_is_on():
    assert next_job([0, 1, 1, 2], mine=1, others={0}) == 1
    assert next_job([0, 0, 1, 2], mine=5, others={0}) == 2
    assert next_job([0, 0, 1], mine=None, others={0, 1}) is None  # every problem taken: it waits
    assert next_job([], mine=1, others=set()) is None
    assert next_job([3], mine=None, others=set()) == 0


def test_a_killed_worker_has_its_job_retried_and_nothing_is_lost_or_duplicated(cluster, tmp_path):
    died = tmp_path / "died"
    task = _task(tmp_path, {1: f"die-once:{died}"})
    records = run_sweep(_sweep(task, tmp_path / "out"), executor=make_ray_executor(workers=2))
    assert died.exists()  # a worker did exit mid-sweep
    lines = _lines(tmp_path / "out")
    keys = [(d["problem"], d["strategy"]) for d in lines]
    assert len(keys) == len(set(keys)) == len(SUMS) * len(SPECS)
    retried = [r for r in records if r.problem == "2"]  # line 2 of the file: 4+4
    assert [(r.answer, r.correct, r.error) for r in retried] == [("8", True, None)] * len(SPECS)


def test_a_job_that_kills_every_worker_is_a_typed_error_not_an_endless_retry(cluster, tmp_path):
    task = _task(tmp_path, {0: "die-always"})
    start = time.monotonic()
    with pytest.raises(WorkerLost, match="killed its worker 2 times"):
        run_sweep(_sweep(task, tmp_path / "out", specs=("greedy",)), executor=make_ray_executor(workers=2, max_retries=1))
    assert time.monotonic() - start < 30
    assert all(d["problem"] != "1" for d in _lines(tmp_path / "out"))


def test_a_worker_that_cannot_be_built_raises_its_typed_error_in_the_driver(cluster, tmp_path):
    task = _task(tmp_path)
    with pytest.raises(ModelNotFound, match="/nonexistent/model"):
        run_sweep(_sweep(task, tmp_path / "a", "metaloom.testing.eval_fixtures:missing_model"),
                  executor=make_ray_executor(workers=2))
    assert (tmp_path / "a" / RECORDS).read_text() == ""
    with pytest.raises(WorkerFailed, match="ModuleNotFoundError") as err:
        run_sweep(_sweep(task, tmp_path / "b", "no_such_module_here:make"), executor=make_ray_executor(workers=1))
    assert "no_such_module_here" in err.value.remote_traceback


def test_results_are_emitted_as_they_finish(cluster, tmp_path):
    """Job 0 waits for a file that the driver's ``emit`` creates on the first outcome: it can
    only finish (correctly) if another job's outcome was emitted while it ran."""
    flag = tmp_path / "first-emitted"
    task = _task(tmp_path, {0: f"wait-for:{flag}"})
    seen: list[Outcome] = []

    def emit(outcome: Outcome) -> None:
        seen.append(outcome)
        flag.touch()

    make_ray_executor(workers=2)(Setup(task=task, factory=FACTORY), [Job(i, "greedy") for i in range(3)], emit)
    assert seen[0].record.problem != "1"
    assert {o.record.problem: o.record.correct for o in seen} == {"1": True, "2": True, "3": True}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("scheme", ["", "ray://"])
def test_an_address_that_does_not_answer_is_a_typed_error_before_anything_is_written(tmp_path, scheme):
    sweep = _sweep(_task(tmp_path), tmp_path / "out")
    start = time.monotonic()
    port = _free_port()
    with pytest.raises(InvalidParameter, match="ray_address") as err:
        run_sweep(sweep, executor=make_ray_executor(address=f"{scheme}127.0.0.1:{port}", connect_timeout=2))
    # the address as given (Ray reaches localhost through this node's own address; it used to
    # report only that one)
    assert f"({scheme}127.0.0.1:{port}" in str(err.value)
    assert time.monotonic() - start < 5
    assert not (tmp_path / "out").exists()


def test_a_port_that_accepts_but_is_not_ray_is_refused_within_the_timeout():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()  # the kernel completes the handshake; nothing ever speaks
        start = time.monotonic()
        with pytest.raises(InvalidParameter, match="no answer within 1s"):
            make_ray_executor(address=f"127.0.0.1:{server.getsockname()[1]}", connect_timeout=1)
        assert time.monotonic() - start < 4


@pytest.mark.parametrize("address", ["nonsense", "host:notaport", "ray://", ""])
def test_malformed_addresses_are_refused(address):
    with pytest.raises(InvalidParameter, match="ray_address"):
        make_ray_executor(address=address)


def test_bad_settings_are_refused():
    for kwargs in ({"workers": 0}, {"num_cpus_per_worker": 0}, {"max_retries": -1}, {"connect_timeout": 0}):
        with pytest.raises(InvalidParameter):
            make_ray_executor(**kwargs)


def test_auto_reads_ray_address_from_the_environment(monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", f"ray://127.0.0.1:{_free_port()}")
    with pytest.raises(InvalidParameter, match="ray_address='auto'"):
        make_ray_executor(address="auto", connect_timeout=1)


def test_a_running_clusters_address_passes_the_probe(cluster, monkeypatch):
    probe(ray.get_runtime_context().gcs_address, 2)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    probe("auto", 2)  # finds the running cluster


def test_a_cluster_the_executor_starts_is_shut_down_after_the_sweep(tmp_path):
    """Last: it shuts the module's cluster down to start its own."""
    ray.shutdown()
    records = run_sweep(_sweep(_task(tmp_path), tmp_path / "out", specs=("greedy",)),
                        executor=make_ray_executor(workers=1))
    assert [r.correct for r in records] == [True] * len(SUMS)
    assert not ray.is_initialized()

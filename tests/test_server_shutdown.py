"""Bounded shutdown of the server (issue 30): on SIGINT/SIGTERM new requests get 503, requests in
flight run for up to ``--shutdown-timeout`` seconds and are then ended with an error their
clients see; a second signal ends them at once; the process exits 0 without tracebacks."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx2 as httpx
import pytest

from metaloom.decode.specs import BeamParams
from metaloom.errors import Interrupted, InvalidParameter
from metaloom.generator import LocalGenerator, Request
from metaloom.generator.types import StreamChunk
from metaloom.ledger import Ledger
from metaloom.sampling import SamplingParams
from metaloom.server.app import create_app
from metaloom.server.scheduler import Failed, Finished, Scheduler, ShuttingDown
from metaloom.testing.served import serve_app
from metaloom.testing.tiny import tiny_llama

METALOOM = os.path.join(os.path.dirname(sys.executable), "metaloom")


class Clock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="module")
def generator():
    return LocalGenerator(tiny_llama())


def _wait(predicate, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


# --- the drain, on the scheduler ---------------------------------------------------------------

def test_drain_lets_requests_finish_until_the_deadline_then_ends_the_rest(generator):
    clock = Clock()
    scheduler = Scheduler(generator, max_rows=8, max_waiting=8, clock=clock)
    reached, gate = threading.Event(), threading.Event()
    long_events: list = []

    def slow_sink(event) -> None:  # holds the loop thread at the first chunk, then paces it
        long_events.append(event)
        if not reached.is_set():
            reached.set()
            assert gate.wait(20)
        time.sleep(0.005)

    try:
        long = scheduler.submit(Request("abc", SamplingParams(max_tokens=240, ignore_eos=True, temperature=0)),
                                Ledger(), slow_sink)
        assert reached.wait(20)
        scheduler.begin_drain(5.0)  # until clock 1005
        assert scheduler.draining and not scheduler.drained.is_set()
        short_events: list = []  # work submitted during the drain by what runs (a strategy's next sample) still runs
        short = scheduler.submit(Request("abc", SamplingParams(max_tokens=2, temperature=0)), Ledger(),
                                 short_events.append)
        gate.set()
        _wait(lambda: short.done)
        assert isinstance(short_events[-1], Finished) and len(short_events[-1].completions[0].token_ids) == 2
        assert not long.done and not scheduler.drained.is_set()
        clock.now = 1005.0  # the deadline: what still runs is ended at the next step boundary
        _wait(scheduler.drained.is_set)
        assert long.done and isinstance(long_events[-1], Failed) and isinstance(long_events[-1].error, ShuttingDown)
        produced = sum(len(e.token_ids) for e in long_events if isinstance(e, StreamChunk))
        assert 0 < produced < 240
        assert scheduler.stats().running_rows == 0
        with pytest.raises(ShuttingDown):
            scheduler.submit(Request("abc", SamplingParams(max_tokens=2)), Ledger(), lambda e: None)
        with pytest.raises(ShuttingDown):
            scheduler.call(lambda: None)
    finally:
        gate.set()
        scheduler.close()


def test_drain_of_an_idle_scheduler_is_done_at_once_and_a_later_call_only_brings_it_closer(generator):
    clock = Clock()
    scheduler = Scheduler(generator, clock=clock)
    try:
        with pytest.raises(InvalidParameter):
            scheduler.begin_drain(-1)
        scheduler.begin_drain(30)
        assert scheduler.drained.wait(5)
        scheduler.begin_drain(60)
        assert scheduler._deadline == 1030.0
        scheduler.begin_drain(0)
        assert scheduler._deadline == 1000.0
    finally:
        scheduler.close()


def test_a_draining_app_refuses_new_requests_with_503(generator):
    app = create_app(generator, model_ids=["default"])
    with serve_app(app) as url:
        body = {"model": "default", "prompt": "abc", "max_tokens": 2}
        assert httpx.post(url + "/v1/completions", json=body, timeout=30).status_code == 200
        app.state.scheduler.begin_drain(10)
        r = httpx.post(url + "/v1/completions", json=body, timeout=30)
        assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down"
        assert "shutting down" in r.json()["error"]["message"]
        health = httpx.get(url + "/health", timeout=30)
        assert health.status_code == 503 and health.json()["status"] == "draining"


# --- the real process ------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _Stream(threading.Thread):
    """A long streamed completion; keeps every SSE data line."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url, self.lines, self.first, self.error = url, [], threading.Event(), None

    def run(self) -> None:
        body = {"model": "default", "prompt": "Once upon a time", "max_tokens": 4000, "ignore_eos": True,
                "temperature": 0, "stream": True}
        try:
            with httpx.stream("POST", self.url + "/v1/completions", json=body, timeout=120) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        self.lines.append(line[6:])
                        self.first.set()
        except Exception as exc:  # reported by the test
            self.error = exc


def _start(timeout_s: float):
    port = _free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen([METALOOM, "serve", "--port", str(port), "--shutdown-timeout", str(timeout_s)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "the server did not start"
        time.sleep(0.2)


def _draining(url: str) -> None:
    _wait(lambda: httpx.get(url + "/health", timeout=5).status_code == 503, timeout=10)


def _clean_exit(proc, within: float) -> str:
    started = time.monotonic()
    try:
        _, err = proc.communicate(timeout=within)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
        pytest.fail(f"still running {within} s after the signal:\n{err[-3000:]}")
    assert proc.returncode == 0, err[-3000:]
    assert "Traceback" not in err and "terminate" not in err, err[-3000:]
    return f"{time.monotonic() - started:.1f}"


@pytest.mark.model
def test_sigint_drains_for_the_timeout_then_exits_cleanly_and_the_stream_gets_an_ending():
    proc, url = _start(timeout_s=2)
    try:
        stream = _Stream(url)
        stream.start()
        assert stream.first.wait(60)
        signalled = time.monotonic()
        proc.send_signal(signal.SIGINT)
        _draining(url)
        r = httpx.post(url + "/v1/completions", json={"model": "default", "prompt": "hi", "max_tokens": 2}, timeout=10)
        assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down"
        _clean_exit(proc, within=2 + 20)
        assert time.monotonic() - signalled >= 2  # it drained for the timeout first (the request ran on)
        stream.join(10)
        assert stream.error is None and stream.lines[-1] == "[DONE]"
        ending = json.loads(stream.lines[-2])
        assert ending["error"]["code"] == "shutting_down"
        assert sum(1 for line in stream.lines if '"text"' in line) > 1  # tokens came before the ending
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


@pytest.mark.model
def test_a_second_sigint_stops_at_once_cleanly():
    proc, url = _start(timeout_s=300)
    try:
        stream = _Stream(url)
        stream.start()
        assert stream.first.wait(60)
        proc.send_signal(signal.SIGINT)
        _draining(url)
        proc.send_signal(signal.SIGINT)
        _clean_exit(proc, within=20)  # not the 300 s drain
        stream.join(10)
        assert stream.lines[-1] == "[DONE]" and json.loads(stream.lines[-2])["error"]["code"] == "shutting_down"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def test_a_beam_search_running_on_the_loop_is_stopped_at_the_deadline():
    """Beam search runs as a lane beside the decode batches, one forward per loop iteration: the
    loop ends it at the first step boundary past the deadline (here, right after its prefill)."""
    loaded = tiny_llama()
    model = loaded.model
    started, gate = threading.Event(), threading.Event()
    forward = model.forward

    def held(*args, **kwargs):  # the first forward (the prefill) waits until the deadline passed
        if not started.is_set():
            started.set()
            assert gate.wait(20)
        return forward(*args, **kwargs)

    model.forward = held
    clock = Clock()
    scheduler = Scheduler(LocalGenerator(loaded), clock=clock)
    events: list = []
    ledger = Ledger()
    try:
        ticket = scheduler.submit(Request("abc", SamplingParams(max_tokens=200, ignore_eos=True),
                                          decoder=BeamParams(beams=4)), ledger, events.append)
        assert started.wait(20)
        scheduler.begin_drain(5.0)
        clock.now = 1005.0
        gate.set()
        _wait(lambda: ticket.done)
        assert isinstance(events[-1], Failed) and isinstance(events[-1].error, ShuttingDown)
        assert ledger.usage.forward_passes == 1  # the prefill it was in, charged; no step after it
        _wait(scheduler.drained.is_set)
    finally:
        gate.set()
        scheduler.close()


def test_a_stopped_ledger_records_the_charge_then_interrupts():
    flag = {"stop": False}
    parent = Ledger(stop=lambda: flag["stop"])
    child = Ledger(parent=parent)
    child.charge(forward_passes=1)
    flag["stop"] = True
    with pytest.raises(Interrupted):
        child.charge(forward_passes=1)
    assert parent.usage.forward_passes == 2 and not child.over_budget()  # charged; a stop is no budget

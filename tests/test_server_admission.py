"""Admission to the server's decode loop (issue 30): only requests that cannot be admitted count
as waiting, so many clients arriving at once on free rows are never refused; a refusal's
Retry-After comes from the queue and the observed drain rate."""

from __future__ import annotations

import contextlib
import threading

import pytest

from metaloom.errors import InvalidParameter
from metaloom.generator import LocalGenerator, Request
from metaloom.ledger import Ledger
from metaloom.sampling import SamplingParams
from metaloom.server.admission import DrainRate, Overloaded, admissible, prefill_tokens, retry_after, within_budget
from metaloom.server.errors import api_error
from metaloom.server.scheduler import Scheduler
from metaloom.testing.tiny import tiny_llama


@pytest.fixture(scope="module")
def generator():
    return LocalGenerator(tiny_llama())


@contextlib.contextmanager
def held(scheduler: Scheduler):
    """The loop thread busy (inside a call) for the duration: nothing queued is admitted, as when
    requests arrive during one long step."""
    started, gate = threading.Event(), threading.Event()
    scheduler.call(lambda: (started.set(), gate.wait(30)))
    assert started.wait(10)
    try:
        yield
    finally:
        gate.set()


def _request(n: int = 1, max_tokens: int = 4) -> Request:
    return Request("abc", SamplingParams(n=n, max_tokens=max_tokens, temperature=0))


def _submit(scheduler: Scheduler, request: Request):
    return scheduler.submit(request, Ledger(), lambda event: None)


class Clock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


# --- pure rules --------------------------------------------------------------------------------

def test_admissible_takes_what_fits_first_in_first_out():
    assert admissible([], 64, busy=False) == 0
    assert admissible([1] * 64, 64, busy=False) == 64
    assert admissible([1] * 72, 64, busy=False) == 64
    assert admissible([1] * 72, 10, busy=True) == 10
    assert admissible([4, 8, 1], 10, busy=True) == 1  # the 8 waits, and the 1 behind it (no overtaking)
    assert admissible([100, 1], 64, busy=False) == 1  # wider than every row: alone, when nothing runs
    assert admissible([100], 64, busy=True) == 0


def test_within_budget_admits_prompts_up_to_the_budget_and_always_the_first():
    assert within_budget([500, 700, 900, 10], 2048) == 2  # 500 + 700 + 900 = 2100 > 2048: the third waits
    assert within_budget([500, 700, 800, 48], 2048) == 4  # exactly 2048
    assert within_budget([5000, 1], 2048) == 1  # a prompt over the budget goes alone
    assert within_budget([], 2048) == 0
    assert within_budget([0, 0, 3], 2) == 2  # beam searches count nothing


def test_prefill_tokens_counts_each_distinct_prompt_once():
    from metaloom.decode.joining import NewRow

    params = SamplingParams(max_tokens=4)
    group = [NewRow(prompt=(1, 2, 3), params=params, ledger=Ledger(), group="g") for _ in range(4)]
    alone = NewRow(prompt=(1, 2), params=params, ledger=Ledger(), secondary=(7, 8, 9))
    assert prefill_tokens(group) == 3  # n samples share one prefill
    assert prefill_tokens([*group, alone]) == 3 + 2 + 3  # a second stream's prompt is prefilled too
    assert prefill_tokens([]) == 0


def test_retry_after_grows_with_the_queue_and_is_an_integer_of_at_least_one_second():
    assert retry_after(0, 5.0, 64) == 1
    assert retry_after(-3, None, 64) == 1
    assert retry_after(1, 100.0, 64) == 1
    assert retry_after(9, 4.0, 64) == 3  # ceil(9 / 4)
    assert retry_after(17, 4.0, 64) == 5
    assert retry_after(128, None, 64) == 2  # no rate yet: a second per max_rows rows ahead
    assert retry_after(10**9, 1.0, 64) == 600
    values = [retry_after(a, 2.5, 64) for a in range(0, 200, 7)]
    assert values == sorted(values) and all(isinstance(v, int) and v >= 1 for v in values)


def test_drain_rate_counts_rows_finished_in_its_window():
    d = DrainRate(window_s=30)
    assert d.rate(0.0) is None
    d.record(10.0, 4)
    assert d.rate(10.0) == 4.0  # at least a second of span
    d.record(12.0, 6)
    assert d.rate(14.0) == pytest.approx(10 / 4)
    assert d.rate(41.0) == pytest.approx(6 / 29)  # the first left the window
    assert d.rate(100.0) is None
    with pytest.raises(InvalidParameter):
        DrainRate(window_s=0)


# --- the scheduler -----------------------------------------------------------------------------

def test_64_rows_max_waiting_8_admits_every_request_that_fits_free_rows(generator):
    """The reported case: many clients at once, rows free. Before the fix the 9th was refused."""
    scheduler = Scheduler(generator, max_rows=64, max_waiting=8)
    try:
        with held(scheduler):
            tickets = [_submit(scheduler, _request()) for _ in range(64)]  # all fit: none waits
            assert scheduler.stats().waiting == 0 and scheduler.stats().queued == 64
            tickets += [_submit(scheduler, _request()) for _ in range(8)]  # no free row: these wait
            assert scheduler.stats().waiting == 8
            with pytest.raises(Overloaded) as refused:
                _submit(scheduler, _request())
            assert refused.value.waiting == 8 and refused.value.retry_after >= 1
        for t in tickets:  # every accepted request is served
            _wait_done(t)
    finally:
        scheduler.close()


def test_a_request_wider_than_the_free_rows_waits_and_counts(generator):
    scheduler = Scheduler(generator, max_rows=64, max_waiting=1)
    try:
        with held(scheduler):
            _submit(scheduler, _request(n=60))
            _submit(scheduler, _request(n=4))  # exactly fills the rows
            _submit(scheduler, _request(n=2))  # waits: 1 of 1
            assert scheduler.stats().waiting == 1
            with pytest.raises(Overloaded):
                _submit(scheduler, _request(n=1))
    finally:
        scheduler.close()


def test_retry_after_comes_from_the_queue_and_the_drain_rate(generator):
    clock = Clock()
    scheduler = Scheduler(generator, max_rows=64, max_waiting=8, clock=clock)
    try:
        with held(scheduler):
            scheduler.drain.record(clock.now - 1.0, 4)  # 4 rows/s observed
            for _ in range(64 + 8):
                _submit(scheduler, _request())
            with pytest.raises(Overloaded) as short:
                _submit(scheduler, _request())
            # 8 rows waiting ahead of it (the 64 about to join fill every row), at 4 rows/s: once
            # they have joined, a retry is at the head of the queue; its own row is not ahead of it
            assert short.value.retry_after == 2
            scheduler.max_waiting = 24
            for _ in range(16):
                _submit(scheduler, _request())
            with pytest.raises(Overloaded) as long:
                _submit(scheduler, _request())
            assert long.value.retry_after == 6  # ceil(24 / 4)
            assert api_error(long.value).headers["Retry-After"] == "6"
            assert api_error(long.value).status == 429
    finally:
        scheduler.close()


def test_finished_rows_feed_the_drain_rate(generator):
    scheduler = Scheduler(generator, max_rows=8, max_waiting=8)
    try:
        _wait_done(_submit(scheduler, _request(n=3)))
        assert scheduler.drain.rate(scheduler.clock()) == pytest.approx(3.0)
    finally:
        scheduler.close()


def _wait_done(ticket, timeout: float = 30.0) -> None:
    import time

    deadline = time.monotonic() + timeout
    while not ticket.done and time.monotonic() < deadline:
        time.sleep(0.01)
    assert ticket.done


# --- prefill between steps -------------------------------------------------------------------

def _logged(monkeypatch, log: list[tuple[str, int]]):
    """Record each batch admission (with the ticket it came from) in ``log``."""
    from metaloom.decode.batch import DecodeBatch

    admit = DecodeBatch.admit

    def logged(self, new):
        log.append(("admit", new[0].tag if new and new[0].tag is not None else -1))
        return admit(self, new)

    monkeypatch.setattr(DecodeBatch, "admit", logged)


def _sink(log: list[tuple[str, int]], i: int):
    def sink(event) -> None:
        if getattr(event, "token_ids", None):
            log.append(("chunk", i))
    return sink


def _burst(generator, monkeypatch, n: int, max_tokens: int, **options) -> list[tuple[str, int]]:
    """Submit ``n`` requests while the loop is held (they arrive together), serve them to the
    end and return the log: admissions, chunks with tokens, and steps (with their rows)."""
    log: list[tuple[str, int]] = []
    _logged(monkeypatch, log)
    scheduler = Scheduler(generator, max_rows=64, on_step=lambda rows: log.append(("step", rows)), **options)
    try:
        with held(scheduler):
            tickets = [scheduler.submit(_request(max_tokens=max_tokens), Ledger(), _sink(log, i)) for i in range(n)]
            for i, t in enumerate(tickets):
                for row in t.rows_to_admit:
                    row.tag = i
        for t in tickets:
            _wait_done(t)
    finally:
        scheduler.close()
    return log


def test_a_burst_sends_each_first_token_before_the_next_prompt_is_prefilled(generator, monkeypatch):
    """Time to first token: request i's first token goes out when its own prompt is prefilled,
    not after the whole burst's prefills."""
    log = _burst(generator, monkeypatch, 4, 3)
    firsts = [e for i, e in enumerate(log) if e[0] == "admit" or (e[0] == "chunk" and e not in log[:i])]
    assert firsts[:8] == [("admit", 0), ("chunk", 0), ("admit", 1), ("chunk", 1),
                          ("admit", 2), ("chunk", 2), ("admit", 3), ("chunk", 3)]


def test_running_rows_step_between_the_prefills_of_a_burst_past_max_prefill_tokens(generator, monkeypatch):
    """With max_prefill_tokens below one prompt, each step boundary admits one request (the first
    always goes, however long) and the rows admitted before take a step in between: a second
    token of request 0 comes before request 2 is prefilled."""
    log = _burst(generator, monkeypatch, 3, 6, max_prefill_tokens=1)
    admits = [i for i, e in enumerate(log) if e[0] == "admit"]
    assert [log[i][1] for i in admits] == [0, 1, 2]
    between = log[admits[0]:admits[2]]
    assert ("step", 1) in between and ("step", 2) in between  # 1 row, then 2 rows, stepped between admissions
    assert between.count(("chunk", 0)) >= 2
    with pytest.raises(InvalidParameter, match="max_prefill_tokens"):
        Scheduler(generator, max_prefill_tokens=0)


def test_a_burst_within_max_prefill_tokens_is_admitted_at_one_step_boundary(generator, monkeypatch):
    log = _burst(generator, monkeypatch, 3, 4)
    admits = [i for i, e in enumerate(log) if e[0] == "admit"]
    assert not any(e[0] == "step" for e in log[:admits[-1]])  # all three prefilled before the first step
    assert ("step", 3) in log


def test_serve_refuses_max_prefill_tokens_below_one_before_loading_a_model(capsys):
    from metaloom.cli import main

    assert main(["serve", "--model", "/nonexistent/model.gguf", "--max-prefill-tokens", "0"]) == 2
    err = capsys.readouterr().err
    assert "max_prefill_tokens" in err and "/nonexistent" not in err  # refused before the model is looked at

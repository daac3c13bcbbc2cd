"""KV memory in the server's loop (issue 46): a request that can never fit is refused before any
work; when the pool runs out mid-decode the youngest request is preempted and recomputed, not
failed, and comes out exactly as it would have alone; the pool gives back what a burst grew."""

from __future__ import annotations

import time

import pytest

from metaloom.decode.specs import BeamParams
from metaloom.errors import InvalidParameter
from metaloom.generator import LocalGenerator, Request
from metaloom.ledger import Ledger
from metaloom.sampling import SamplingParams
from metaloom.server.admission import kv_need, too_large
from metaloom.server.memory import shrink_pool
from metaloom.server.scheduler import Failed, Finished, Scheduler
from metaloom.testing.tiny import tiny_llama


def _run(scheduler: Scheduler, requests: list[Request], timeout: float = 120.0) -> list[list[str]]:
    events: list[list] = [[] for _ in requests]
    tickets = [scheduler.submit(r, Ledger(), events[i].append) for i, r in enumerate(requests)]
    deadline = time.monotonic() + timeout
    while not all(t.done for t in tickets):
        assert time.monotonic() < deadline, "requests did not finish"
        time.sleep(0.01)
    out = []
    for evs in events:
        last = evs[-1]
        assert isinstance(last, Finished), last
        out.append([c.text for c in last.completions])
    return out


def _alone(generator: LocalGenerator, request: Request) -> list[str]:
    return [c.text for c in generator.generate([request], ledger=Ledger())[0]]


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=70, ignore_eos=True, temperature=0),
    SamplingParams(max_tokens=70, ignore_eos=True, temperature=1.0, seed=7, n=2),
    SamplingParams(max_tokens=70, ignore_eos=True, temperature=0.8, top_p=0.9, seed=3, frequency_penalty=0.5),
])
def test_a_preempted_request_comes_out_exactly_as_it_would_alone(params):
    generator = LocalGenerator(tiny_llama())
    assert generator.pool is not None
    generator.pool.max_slots = 180  # three requests of ~75 slots each cannot all grow to the end at once
    requests = [Request(prompt, params) for prompt in ("abc", "xyzzy", "hello")]
    expected = [_alone(generator, r) for r in requests]
    scheduler = Scheduler(generator, max_rows=16)
    try:
        got = _run(scheduler, requests)
        assert scheduler.preemptions >= 1  # the pool ran out: someone was preempted, nobody failed
        assert got == expected
    finally:
        scheduler.close()


def test_a_request_that_can_never_fit_is_refused_before_any_work():
    generator = LocalGenerator(tiny_llama())
    assert generator.pool is not None
    generator.pool.max_slots = 100
    scheduler = Scheduler(generator, max_rows=16)
    try:
        steps = scheduler.steps
        with pytest.raises(InvalidParameter) as refused:
            scheduler.submit(Request("abc", SamplingParams(max_tokens=40, n=4)), Ledger(), lambda e: None)
        assert refused.value.name == "max_tokens" and "163 KV slots" in str(refused.value) and "99" in str(refused.value)
        with pytest.raises(InvalidParameter):  # beams reserve their whole search
            scheduler.submit(Request("abc", SamplingParams(max_tokens=40), decoder=BeamParams(beams=4)), Ledger(),
                             lambda e: None)
        assert scheduler.steps == steps
        assert _run(scheduler, [Request("abc", SamplingParams(max_tokens=40, n=2, temperature=0))])  # this one fits
    finally:
        scheduler.close()


def test_kv_need_counts_a_shared_prompt_once():
    generator = LocalGenerator(tiny_llama())
    from metaloom.generator.plan import plan

    rows = plan(generator, Request("abcdef", SamplingParams(max_tokens=10, n=4))).rows(Ledger(), generator.model.device)
    need = kv_need(rows)
    assert (need.start, need.step, need.worst) == (6 + 4, 4, 6 + 40)
    assert kv_need(rows, draft=3).worst == 6 + 4 * 13
    assert too_large(need, 46, 100, 4, 10) is None and too_large(need, 45, 100, 4, 10) is not None


def test_the_pool_gives_back_what_a_burst_grew():
    generator = LocalGenerator(tiny_llama())
    pool = generator.pool
    assert pool is not None
    scheduler = Scheduler(generator, max_rows=64)
    try:
        start = pool.slots
        _run(scheduler, [Request("abc", SamplingParams(max_tokens=120, n=16, ignore_eos=True, temperature=1.0, seed=1))])
        deadline = time.monotonic() + 10
        while pool.slots > start and time.monotonic() < deadline:  # the idle loop compacts it
            time.sleep(0.05)
        assert pool.slots <= start, "the KV pool kept its burst size"
    finally:
        scheduler.close()


def test_compaction_keeps_what_the_prefix_cache_holds():
    from metaloom.prefix import PrefixCache

    generator = LocalGenerator(tiny_llama(), prefix_cache=PrefixCache(budget_bytes=100 * 256))  # ~100 tokens
    pool = generator.pool
    assert pool is not None
    burst = Request("abcdefgh", SamplingParams(max_tokens=60, n=16, ignore_eos=True, temperature=1.0, seed=1))
    generator.generate([burst], ledger=Ledger())
    grown = pool.slots
    again = Request("abcdefgh" + "a" * 3, SamplingParams(max_tokens=8, temperature=0))
    before = _alone(generator, again)
    assert shrink_pool(generator) is not None and pool.slots < grown
    ledger = Ledger()
    after = [c.text for c in generator.generate([again], ledger=ledger)[0]]
    assert after == before and ledger.usage.cached_tokens > 0  # the cached prefix survived the move, intact


def test_a_preempted_request_that_is_cancelled_ends_cleanly():
    generator = LocalGenerator(tiny_llama())
    assert generator.pool is not None
    generator.pool.max_slots = 180
    scheduler = Scheduler(generator, max_rows=16)
    try:
        events: list[list] = [[], [], []]
        params = SamplingParams(max_tokens=70, ignore_eos=True, temperature=0)
        tickets = [scheduler.submit(Request(p, params), Ledger(), events[i].append)
                   for i, p in enumerate(("abc", "xyzzy", "hello"))]
        deadline = time.monotonic() + 60
        while scheduler.preemptions == 0 and time.monotonic() < deadline:
            time.sleep(0.005)
        for t in tickets:
            t.cancel()
        while not all(t.done for t in tickets) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert all(t.done for t in tickets)
        assert not any(isinstance(e[-1], Failed) for e in events)
    finally:
        scheduler.close()

"""One HTTP call's run: a plain request submitted to the scheduler and waited for or streamed,
or a strategy run in a worker against `ScheduledGenerator`; the OpenAI response built from it."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from metaloom.decode.score import PromptPosition, shared_prompt_logprobs
from metaloom.errors import InvalidGrammar, InvalidParameter
from metaloom.generator.plan import check_ids, encode
from metaloom.generator.types import Completion, StreamChunk, TokenIds
from metaloom.generator.types import Request as GenerationRequest
from metaloom.ledger import Ledger
from metaloom.meta.types import Result
from metaloom.score.protocols import Raw
from metaloom.server.admission import Overloaded
from metaloom.server.bodies import ChatFields, CompletionFields
from metaloom.server.choices import Choices, Prompted
from metaloom.server.errors import ApiError
from metaloom.server.limits import Limits
from metaloom.server.metrics import Metrics
from metaloom.server.responses import finish_of, jsonable, usage_block
from metaloom.server.scheduled import Cancelled, ScheduledGenerator
from metaloom.server.scheduler import Event, Failed, Finished, Scheduler, Ticket
from metaloom.server.strategy import StrategyCall

DISCONNECT_CHECK = 0.5  # seconds between checks that a waiting client is still there


class StrategyGate:
    """Strategies in flight: ``workers`` run, up to ``waiting`` more queue for a worker; past
    that a request is refused (429), never an unbounded backlog. Used on the event loop only."""

    def __init__(self, workers: int, waiting: int) -> None:
        self.workers, self.waiting, self.inside = workers, waiting, 0

    def enter(self) -> None:
        if self.inside >= self.workers + self.waiting:
            raise Overloaded(self.inside - self.workers, self.waiting, retry_after=5, what="a strategy worker")
        self.inside += 1

    def leave(self) -> None:
        self.inside -= 1


class Call(Choices):
    """One HTTP call's run: submit, wait or stream, build the OpenAI response (its choices:
    `Choices`)."""

    def __init__(self, scheduler: Scheduler, metrics: Metrics, workers: ThreadPoolExecutor, http: Request,
                 limits: Limits, gate: StrategyGate, *, chat: bool, model: str, logprobs: bool,
                 token_ids: bool = False) -> None:
        super().__init__(metrics, scheduler.generator.tokenizer, chat=chat, model=model, logprobs=logprobs,
                         token_ids=token_ids)
        self.scheduler, self.workers, self.http = scheduler, workers, http
        self.limits, self.gate = limits, gate
        self.continuous_usage = False  # stream_options.continuous_usage_stats
        self.constraint_field: str | None = None  # the field whose constraint the request carries
        self._check_at = time.monotonic() + DISCONNECT_CHECK  # when `_next` next asks whether the client left

    # --- plain requests ----------------------------------------------------------------------
    def fit(self, requests: list[GenerationRequest], body: ChatFields | CompletionFields) -> list[GenerationRequest]:
        """The requests within the server's limits (`Limits`: rows, beams, stop strings, generated
        tokens), refused before any work when over one. Without ``max_tokens``, a request may fill
        the context window (as OpenAI and vLLM do), up to its share of ``max_request_tokens``."""
        limits = self.limits
        first = requests[0]
        beams = getattr(first.decoder, "beams", None)
        limits.check_rows(first.params.n, len(requests))
        if beams is not None:
            limits.check_beams(beams)
        limits.check_stop(first.params.stop)
        rows = len(requests) * max(first.params.n, beams or 0)
        if body.max_tokens is not None or getattr(body, "max_completion_tokens", None) is not None:
            limits.check_tokens(rows, first.params.max_tokens)
            return requests
        engine = self.scheduler.generator
        out = []
        for r in requests:
            used = len(r.prompt.ids) if isinstance(r.prompt, TokenIds) else len(encode(engine, r.prompt))
            room = engine.model.max_context - used
            if room > 0:
                r = dataclasses.replace(r, params=dataclasses.replace(r.params, max_tokens=limits.default_tokens(rows, room)))
            out.append(r)
        return out

    async def read_prompts(self, requests: list[GenerationRequest], k: int | None, ledger: Ledger, *,
                           count_input: bool) -> list[Prompted]:
        """Each request's prompt as text and ids; with ``k``, their log-probabilities too (one pass
        over them all, what they share computed once, on the loop thread between two steps)."""
        engine = self.scheduler.generator
        ids = [list(r.prompt.ids) if isinstance(r.prompt, TokenIds) else encode(engine, r.prompt) for r in requests]
        positions: list[list[PromptPosition] | None] = [None] * len(requests)
        if k is None and count_input:
            ledger.charge(input_tokens=sum(map(len, ids)))
        elif k is not None:  # one pass for all: what the prompts share is computed once (decode.score)
            for one in ids:
                check_ids("prompt ids", one, engine.model.vocab_size)
            def read(k: int = k) -> list[list[PromptPosition]]:
                started = time.perf_counter()
                try:
                    return shared_prompt_logprobs(engine.model, ids, k, ledger, pool=engine.pool, count_input=count_input)
                finally:
                    ledger.charge(seconds=time.perf_counter() - started)
            positions = list(await asyncio.wrap_future(self.scheduler.call(read)))
        return [Prompted(r.prompt if isinstance(r.prompt, str) else self.tokenizer.decode(i), i, p)
                for r, i, p in zip(requests, ids, positions, strict=True)]

    def prompts_only(self, choices: int, stream: bool, include_usage: bool,
                     ledger: Ledger) -> StreamingResponse | dict[str, Any]:
        """``echo`` with ``max_tokens: 0``: each prompt back (with its log-probabilities), nothing generated."""
        assert self.prompts is not None
        n = choices // len(self.prompts)
        empty = Completion(text="", token_ids=(), logprobs=(), finish_reason="length")
        self._observe(ledger.usage, [])
        if stream:
            async def events() -> AsyncIterator[dict[str, Any]]:
                for i in range(choices):
                    out = self._chunk(i, {"text": ""}, "length")
                    self._decorate(out["choices"][0], i // n, empty)
                    yield out
                if include_usage:
                    yield self._usage_chunk(ledger.usage)
            return self._sse(events())
        return {"id": self.id, "object": self.object, "created": self.created, "model": self.model,
                "choices": [self._choice(i, empty, i // n) for i in range(choices)], "usage": usage_block(ledger.usage)}

    async def plain(self, requests: list[GenerationRequest], stream: bool, include_usage: bool,
                    ledger: Ledger) -> StreamingResponse | dict[str, Any]:
        loop = asyncio.get_running_loop()
        inbox: asyncio.Queue[tuple[int, Event]] = asyncio.Queue()
        tickets: list[Ticket] = []
        try:
            for i, r in enumerate(requests):  # all validated (a bad one raises: 400) before any compute
                def sink(event: Event, i: int = i) -> None:
                    loop.call_soon_threadsafe(inbox.put_nowait, (i, event))
                tickets.append(self.scheduler.submit(r, ledger, sink))
        except InvalidGrammar as exc:  # named as the request set it, in one sentence
            for t in tickets:
                t.cancel()
            field = self.constraint_field or "constraint"
            raise ApiError(400, f"{field}: {exc}", "invalid_request_error", param=field, code="invalid_grammar") from exc
        except BaseException:
            for t in tickets:
                t.cancel()
            raise
        n = requests[0].params.n
        self.tickets, self.n = tickets, n
        if stream:
            return self._sse(self._stream_plain(inbox, tickets, ledger, n, include_usage))
        try:
            results: dict[int, tuple[Completion, ...]] = {}
            while len(results) < len(requests):
                i, event = await self._next(inbox)
                if isinstance(event, Failed):
                    raise event.error
                if isinstance(event, Finished):
                    results[i] = event.completions
                elif self.tools and isinstance(event, StreamChunk):  # read as it comes: a repeated call ends the row
                    self._read_calls(i * n + event.index, event.text)
        finally:
            for t in tickets:
                t.cancel()  # a no-op for finished ones; frees the rows of a client gone away
            self._observe(ledger.usage, tickets)  # what was generated, for a client gone away too
        choices = [self._choice(i * n + j, c, i) for i in range(len(requests)) for j, c in enumerate(results[i])]
        return {"id": self.id, "object": self.object, "created": self.created, "model": self.model,
                "choices": choices, "usage": usage_block(ledger.usage)}

    async def _next(self, inbox: asyncio.Queue[tuple[int, Event]]) -> tuple[int, Event]:
        """The next event; a client that went away cancels the request (checked twice a second,
        whether or not events arrive: a fast model's tokens never leave the queue empty that long)."""
        while True:
            if time.monotonic() >= self._check_at:
                self._check_at = time.monotonic() + DISCONNECT_CHECK
                if await self.http.is_disconnected():
                    raise Cancelled("client disconnected")
            try:
                return await asyncio.wait_for(inbox.get(), timeout=max(0.0, self._check_at - time.monotonic()))
            except TimeoutError:
                continue

    async def _stream_plain(self, inbox: asyncio.Queue[tuple[int, Event]], tickets: list[Ticket], ledger: Ledger, n: int,
                            include_usage: bool) -> AsyncIterator[dict[str, Any]]:
        observed = False
        try:
            if self.chat:
                for j in range(n):
                    yield self._chunk(j, {"role": "assistant", "content": ""})
            elif self.prompts is not None:  # echo / prompt_logprobs: the prompt first, once per choice
                empty = Completion(text="", token_ids=(), logprobs=(), finish_reason="length")
                for i in range(len(tickets) * n):
                    out = self._chunk(i, {"text": ""})
                    self._decorate(out["choices"][0], i // n, empty)
                    yield out
            finished = 0
            sent: dict[int, int] = {}
            while finished < len(tickets):
                i, event = await inbox.get()
                if isinstance(event, Failed):
                    raise event.error
                if isinstance(event, Finished):
                    finished += 1
                    continue
                assert isinstance(event, StreamChunk)
                index = i * n + event.index
                outs = self._tool_deltas(index, event) if self.tools else [self._delta(index, event)]
                if self.continuous_usage:  # vLLM's meaning: this choice's tokens so far, beside the request's prompt
                    sent[index] = sent.get(index, 0) + len(event.token_ids)
                    prompt = ledger.usage.input_tokens
                    outs[-1]["usage"] = {"prompt_tokens": prompt, "completion_tokens": sent[index],
                                         "total_tokens": prompt + sent[index]}
                for out in outs:
                    yield out
            observed = True
            self._observe(ledger.usage, tickets)
            if include_usage:
                yield self._usage_chunk(ledger.usage)
        finally:
            for t in tickets:
                t.cancel()
            if not observed:  # a stream the client closed: its tokens were generated all the same
                self._observe(ledger.usage, tickets)

    # --- strategies -----------------------------------------------------------------------------
    async def strategy(self, call: StrategyCall, request: GenerationRequest, stream: bool,
                       include_usage: bool) -> StreamingResponse | dict[str, Any]:
        loop = asyncio.get_running_loop()
        progress: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        prompt, sampling = request.prompt, request.params
        if isinstance(prompt, TokenIds):  # strategies and their scorers read the question as text
            raise ApiError(400, "a strategy takes a text prompt or chat messages, not token ids", "invalid_request_error",
                           param="prompt")
        if isinstance(prompt, str):  # /v1/completions: the text as it is (a strategy reads a plain str as chat)
            prompt = Raw(prompt)
        if sampling.n != 1:  # the rest was checked with the call (names, types, values); this needs the body
            raise InvalidParameter("n", sampling.n, "1 with a strategy (its samples are its own parameter, e.g. n)")
        self.limits.check_stop(sampling.stop)
        tally: dict[str, Any] = {"calls": 0, "samples_finished": 0, "output_tokens": 0}

        def on_done(completions: tuple[Completion, ...]) -> None:  # a generator call finished
            tally["calls"] += 1
            tally["samples_finished"] += len(completions)
            tally["output_tokens"] += sum(len(c.token_ids) for c in completions)
            loop.call_soon_threadsafe(progress.put_nowait, dict(tally))

        def on_event(kind: str, data: dict[str, Any]) -> None:  # a step of the strategy's trace: votes so far, ...
            loop.call_soon_threadsafe(progress.put_nowait, {**tally, "trace": jsonable({"kind": kind, **data})})

        gen = ScheduledGenerator(self.scheduler, on_done=on_done)
        # the stop: a strategy whose client left ends at its next charge, not only at its next generator call
        ledger = Ledger(budget=call.budget, listener=on_event if stream else None, stop=lambda: gen.cancelled)
        self.gate.enter()  # strategies in flight are bounded as requests waiting for rows are (429 beyond)
        # built in the worker: a component may load a model (a reward model), which must not block the event loop
        future = loop.run_in_executor(self.workers, lambda: call.build(sampling, gen).run(prompt, gen, ledger=ledger))
        future.add_done_callback(lambda _: self.gate.leave())
        if stream:
            return self._sse(self._stream_strategy(call, future, progress, gen, ledger, include_usage))
        try:
            while True:
                done, _ = await asyncio.wait({future}, timeout=DISCONNECT_CHECK)
                if done:
                    break
                if await self.http.is_disconnected():
                    raise Cancelled("client disconnected")
        finally:
            if not future.done():
                gen.cancel()
        result = future.result()
        self._observe(result.usage, [])
        return {"id": self.id, "object": self.object, "created": self.created, "model": self.model,
                "choices": [self._strategy_choice(result)], "usage": usage_block(result.usage),
                "metaloom": call.report(result)}

    async def _stream_strategy(self, call: StrategyCall, future: asyncio.Future[Result],
                               progress: asyncio.Queue[dict[str, Any]],
                               gen: ScheduledGenerator, ledger: Ledger, include_usage: bool) -> AsyncIterator[dict[str, Any]]:
        try:
            if self.chat:
                yield self._chunk(0, {"role": "assistant", "content": ""})
            while not future.done():
                getter = asyncio.ensure_future(progress.get())
                waiting: set[asyncio.Future[Any]] = {future, getter}
                done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
                if getter in done:
                    yield self._progress(call, getter.result())
                else:
                    getter.cancel()
            while not progress.empty():
                yield self._progress(call, progress.get_nowait())
            result = future.result()
            self._observe(result.usage, [])
            text = {"content": result.best} if self.chat else {"text": result.best}
            yield self._chunk(0, text)
            yield self._chunk(0, {} if self.chat else {"text": ""}, finish=finish_of(result))
            if include_usage:
                yield {"id": self.id, "object": self._chunk_object, "created": self.created, "model": self.model,
                       "choices": [], "usage": usage_block(result.usage), "metaloom": call.report(result)}
        finally:
            if not future.done():
                gen.cancel()

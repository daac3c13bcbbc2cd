"""`RemoteGenerator`: the `Generator` protocol over an OpenAI-compatible server (vLLM, SGLang,
llama.cpp's server, metaloom serve, OpenAI itself), so every strategy runs there unchanged.

Chat prompts go to /v1/chat/completions; text and token-id prompts, and anything continued
from a token-id ``prefix`` (the prompt's ids, from the server's /tokenize or a local
tokenizer, then the prefix), to /v1/completions. A request is checked against what the server
was found to do (`detect`) and refused with `Unsupported` before anything is sent (`plan`:
the checks, and the HTTP requests a request becomes).

Accounting: the ledger is charged from each successful response's ``usage`` (prompt, cached,
completion tokens), once — a failed attempt that is retried charges nothing. Forward passes
and FLOPs are exact only from metaloom's own server (its ``usage.metaloom`` block); elsewhere
FLOPs are estimated as 2 · ``model_params`` · tokens computed (marked in `Usage.estimated`), and
forward passes are marked unknown (`Usage.unknown`: reported as null, and a budget on them is an
error, never a limit silently not enforced); `RemoteGenerator.accounting` says which is which.
Seconds are the caller's wall time, as for the local engine. A stream closed early
has no final usage (unless the server reports usage in every chunk, as vLLM can): it is charged
the tokens it received and its prompt (counted by /tokenize or a local tokenizer, where there is
one) — the server may have generated a few more tokens before it noticed.

Cancellation: closing a stream closes its HTTP connection(s), so the server drops those
samples (first-finish, adaptive strategies); `RemoteGenerator.cancel` does the same for every
request in flight, from any thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import os
import time
import weakref
from collections.abc import AsyncGenerator, AsyncIterator, Coroutine, Iterator, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from metaloom.errors import BudgetExceeded, InvalidParameter
from metaloom.generator.remote.detect import ServerFeatures, capabilities, detect
from metaloom.generator.remote.plan import Call, calls, check, require_chat_tokens
from metaloom.generator.remote.tokens import Tokens, expect_choices, load_tokenizer
from metaloom.generator.remote.transport import EventLoopThread, Json, RetryPolicy, Transport
from metaloom.generator.remote.wire import (
    choices_of,
    completion,
    stream_chunk,
    usage_charge,
)
from metaloom.generator.types import Completion, Message, Prompt, Request, Scored, StreamChunk, TokenIds, check_prompt
from metaloom.ledger import Ledger

if TYPE_CHECKING:
    from metaloom.generator.capabilities import Capabilities
    from metaloom.models.protocols import Tokenizer

T = TypeVar("T")
_DONE = object()


class RemoteGenerator:
    """``base_url``: the server (``http://host:8000`` or ``.../v1``); ``model``: a model id it
    lists; ``tokenizer``: a tokenizer folder (or object) for what the server has no route for
    (token ids of outputs, the chat template, token counts for scoring); ``max_concurrency``:
    requests in flight at once (a stream holds one while open); ``timeout``: seconds per
    attempt (between stream events, for a stream); ``max_retries`` / ``retry``: `RetryPolicy`;
    ``model_params``: parameter count, for FLOPs estimates; ``features``: skip detection and
    take these (`ServerFeatures`).

    Start-up lists the models and probes the server (a dozen one-token requests)."""

    def __init__(self, base_url: str, model: str, *, api_key: str | None = None,
                 tokenizer: str | os.PathLike[str] | Tokenizer | None = None, max_concurrency: int = 16,
                 timeout: float = 600.0, max_retries: int = 3, model_params: float | None = None,
                 retry: RetryPolicy | None = None, features: ServerFeatures | None = None) -> None:
        if not isinstance(model, str) or not model:
            raise InvalidParameter("model", model, "a model id the server lists")
        if model_params is not None and (isinstance(model_params, bool) or not isinstance(model_params, (int, float))
                                         or not math.isfinite(model_params) or model_params <= 0):
            raise InvalidParameter("model_params", model_params, "None or a parameter count > 0")
        self.model = model
        self.model_params = float(model_params) if model_params is not None else None
        self.tokenizer = load_tokenizer(tokenizer)
        self.transport = Transport(base_url, api_key, timeout=timeout, retry=retry or RetryPolicy(max_retries=max_retries),
                                   max_concurrency=max_concurrency)
        self.name = f"the server at {self.transport.root_url} ({model})"
        self._loop = EventLoopThread(f"metaloom-remote-{model}")
        self._finalizer = weakref.finalize(self, self._loop.close)
        self._inflight: set[asyncio.Task[Any]] = set()
        try:
            self._run(self.transport.open())
            tok = self.tokenizer
            local_ids = None if tok is None else (lambda text: tok.encode(text))
            self.features = features if features is not None else self._run(detect(self.transport, model, local_ids))
        except BaseException:
            self.close()
            raise
        self.tokens = Tokens(self.transport, model, self.features, self.tokenizer)
        self._capabilities = capabilities(self.features, self.tokenizer is not None)

    @property
    def capabilities(self) -> Capabilities:
        return self._capabilities

    @property
    def accounting(self) -> dict[str, str]:
        """How each ledger figure this generator charges is known."""
        exact = self.features.exact_usage
        flops = "exact (server)" if exact else "estimate (2 * model_params * tokens)" if self.model_params else "unknown"
        return {"input_tokens": "exact (server usage)", "cached_tokens": "exact (server usage)",
                "output_tokens": "exact (server usage)", "forward_passes": "exact (server)" if exact else "unknown",
                "flops": flops, "seconds": "wall time of the call",
                "kv_bytes_peak": "exact (server), where it reports it" if exact else "unknown"}

    # --- lifecycle ---------------------------------------------------------------------------------
    def close(self) -> None:
        """Close the connections and stop the event loop thread."""
        if not self._loop.loop.is_closed():
            with contextlib.suppress(Exception):
                self._run(self.transport.close())
        self._loop.close()

    def __enter__(self) -> RemoteGenerator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def cancel(self) -> int:
        """Cancel every request now in flight (from any thread): their unfinished samples end
        "cancelled", and the server sees the connections close. Later calls run as usual.
        Returns how many requests were cancelled."""
        async def cancel_all() -> int:  # on the loop's thread, where the set of tasks changes
            tasks = [t for t in self._inflight if not t.done()]
            for task in tasks:
                task.cancel()
            return len(tasks)
        return self._run(cancel_all())

    # --- the Generator protocol ----------------------------------------------------------------------
    def generate(self, requests: Sequence[Request], *, ledger: Ledger) -> list[list[Completion]]:
        for r in requests:  # every request checked before anything is sent
            self._check(r)
        if not requests:
            return []
        if ledger.over_budget():  # as the engine: nothing more is spent once the budget is gone
            return [[Completion("", (), (), "budget") for _ in range(r.params.n)] for r in requests]
        with self._timed(ledger):
            out = self._run(self._generate(requests, ledger))
        return [[_eos_reason(r, c) for c in row] for r, row in zip(requests, out, strict=True)]

    def stream(self, request: Request, *, ledger: Ledger) -> Iterator[StreamChunk]:
        self._check(request)  # a bad request raises here, at the call, not at the first next()
        self.capabilities.require("stream", self.name)
        return self._iterate(request, ledger)

    def score(self, prompt: Prompt, continuations: Sequence[str | TokenIds], *, ledger: Ledger) -> list[Scored]:
        return self.score_many([(prompt, continuations)], ledger=ledger)[0]

    def score_many(self, items: Sequence[tuple[Prompt, Sequence[str | TokenIds]]], *, ledger: Ledger) -> list[list[Scored]]:
        """`score` of several prompts in one request, charged once from its usage: a server that
        shares what its prompts have in common (metaloom serve) computes it once and reports it as
        cached, as the local engine's prefill-once-fork and prefix cache do (an LLM judge's
        questions about one candidate set share the problem)."""
        self.capabilities.require("score", self.name, "needs prompt log-probabilities, token-id prompts and a tokenizer")
        for prompt, continuations in items:
            check_prompt(prompt)
            for i, c in enumerate(continuations):
                if not (isinstance(c, TokenIds) or (isinstance(c, str) and c)):
                    raise InvalidParameter(f"continuations[{i}]", c, "non-empty text or TokenIds")
            if isinstance(prompt, tuple):  # the continuation is cut from the rendered chat
                self._require_chat_tokens("score")
                self.capabilities.require("render", self.name, "to score after a chat prompt")
        asked = [(p, cs) for p, cs in items if cs]
        if not asked:
            return [[] for _ in items]
        with self._timed(ledger):
            scored, data = self._run(self.tokens.score_many(asked))
            self._charge(ledger, data, [])
        found = iter(scored)
        return [next(found) if cs else [] for _, cs in items]

    def render(self, messages: Sequence[Message]) -> str:
        self.capabilities.require("render", self.name, "needs the server's /tokenize and /detokenize or a local tokenizer")
        check_prompt(tuple(messages))
        return self._run(self.tokens.render(messages))

    # --- checks and request bodies (`plan`) ------------------------------------------------------------
    def _check(self, request: Request) -> None:
        check(request, self.features, self.capabilities, self.name, self.tokenizer is not None)

    def _require_chat_tokens(self, what: str) -> None:
        require_chat_tokens(what, self.features, self.name, self.tokenizer is not None)

    async def _calls(self, request: Request) -> list[Call]:
        return await calls(request, self.model, self.features, self.tokens)

    # --- generate ---------------------------------------------------------------------------------------
    async def _generate(self, requests: Sequence[Request], ledger: Ledger) -> list[list[Completion]]:
        plans = await asyncio.gather(*(self._calls(r) for r in requests))
        out: list[list[Completion | None]] = [[None] * r.params.n for r in requests]
        tasks = {asyncio.create_task(self.transport.post(c.path, c.body, expect_choices(c.n))): (i, c)
                 for i, calls in enumerate(plans) for c in calls}
        self._inflight.update(tasks)
        pending = set(tasks)
        ended = "cancelled"  # what an unanswered sample ends as
        try:
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                failed: BaseException | None = None
                for task in done:  # every answer that came is charged, even when another failed
                    if task.cancelled():
                        continue
                    if task.exception() is not None:
                        failed = failed or task.exception()
                        continue
                    if self._collect(task.result(), tasks[task], out, ledger):
                        ended = "budget"  # recorded; what is still out is stopped, as the engine's rows are
                        for t in pending:
                            t.cancel()
                if failed is not None:
                    raise failed
        finally:
            await self._drop(list(tasks))
        return [[c if c is not None else Completion("", (), (), ended) for c in row] for row in out]

    def _collect(self, data: Json, where: tuple[int, Call], out: list[list[Completion | None]], ledger: Ledger) -> bool:
        """Put an answer's completions in place and charge its usage; True if that passed the budget."""
        i, call = where
        completions = [completion(c, chat=call.chat, encode=self.tokens.local_encode(False), top=call.top)
                       for c in choices_of(data, call.n)] * call.copies
        out[i][call.first:call.first + call.samples] = completions
        try:
            self._charge(ledger, data, completions)
        except BudgetExceeded:
            return True
        return False

    def _charge(self, ledger: Ledger, data: Json, completions: Sequence[Completion]) -> None:
        amounts = usage_charge(data.get("usage"), self.model_params)
        if not amounts:  # a server that reports no usage: count what came back
            amounts = {"output_tokens": sum(len(c.logprobs) or len(c.token_ids) for c in completions)}
        ledger.charge(**amounts)

    # --- stream -------------------------------------------------------------------------------------------
    def _iterate(self, request: Request, ledger: Ledger) -> Iterator[StreamChunk]:
        if ledger.over_budget():  # as the engine: nothing more is spent once the budget is gone
            yield from (StreamChunk("", (), (), "budget", None, i) for i in range(request.params.n))
            return
        started = time.perf_counter()
        chunks = self._chunks(request, ledger)
        try:
            while True:
                chunk = self._run(_next(chunks))
                if chunk is None:
                    return
                yield _eos_reason(request, chunk)
        finally:  # closing the iterator closes the streams: the server stops those samples
            with contextlib.suppress(RuntimeError):
                self._run(chunks.aclose())
            _charge_time(ledger, time.perf_counter() - started)

    async def _chunks(self, request: Request, ledger: Ledger) -> AsyncGenerator[StreamChunk, None]:
        calls = await self._calls(request)
        queue: asyncio.Queue[Any] = asyncio.Queue()
        tasks = [asyncio.create_task(self._pump(c, ledger, queue)) for c in calls]
        self._inflight.update(tasks)
        try:
            done = 0
            while done < len(tasks):
                item = await queue.get()
                if item is _DONE:
                    done += 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield item
        finally:
            await self._drop(tasks)

    async def _drop(self, tasks: Sequence[asyncio.Task[Any]]) -> None:
        """Cancel what is still running of ``tasks`` (a no-op for the finished), wait for it to end,
        and take them all off the in-flight set."""
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._inflight.difference_update(tasks)

    async def _pump(self, call: Call, ledger: Ledger, queue: asyncio.Queue[Any]) -> None:
        """One streamed request into ``queue``: its chunks, then `_DONE` (or the error)."""
        options: Json = {"include_usage": True}
        if self.features.continuous_usage:
            options["continuous_usage_stats"] = True
        body = {**call.body, "stream": True, "stream_options": options}
        encode = self.tokens.local_encode(False)
        # Output tokens are charged as they arrive (a budget stops a stream mid-way, as the engine's
        # rows stop); the request's total usage, in the last chunk (the one without choices), then
        # settles the rest. Usage inside chunks with choices is vLLM's per-choice running count
        # (continuous_usage_stats): it says nothing of the request's total, only its prompt.
        received = [0] * call.n  # tokens per sample so far (charged)
        finished = [False] * call.samples
        settled = False
        prompt: int | None = None
        try:
            async with contextlib.aclosing(self.transport.events(call.path, body)) as events:
                async for event in events:
                    fresh = 0
                    for choice in event.get("choices") or []:
                        chunk = stream_chunk(choice, chat=call.chat, first_index=call.first, encode=encode, top=call.top)
                        if chunk is None or not 0 <= chunk.index - call.first < call.n:
                            continue
                        k = len(chunk.logprobs) or len(chunk.token_ids) or int(bool(chunk.text))
                        received[chunk.index - call.first] += k
                        fresh += k
                        for j in range(call.copies):  # greedy n > 1: the one sample, under each index
                            copy = chunk if j == 0 else dataclasses.replace(chunk, index=call.first + j)
                            finished[copy.index - call.first] |= chunk.finish_reason is not None
                            queue.put_nowait(copy)
                    usage = event.get("usage")
                    if isinstance(usage, dict) and event.get("choices"):
                        if isinstance(usage.get("prompt_tokens"), int):
                            prompt = usage["prompt_tokens"]
                    elif isinstance(usage, dict):  # the request's total: settle against what was charged
                        total = usage_charge(usage, self.model_params)
                        total["output_tokens"] = max(0, total.get("output_tokens", 0) - (sum(received) - fresh))
                        settled = True
                        ledger.charge(**total)
                        continue
                    if fresh:
                        ledger.charge(output_tokens=fresh)
        except BudgetExceeded:  # recorded; the samples still going end here, as the engine's do
            _end(queue, call, finished, "budget")
        except asyncio.CancelledError:
            _end(queue, call, finished, "cancelled")
            raise
        except Exception as exc:
            queue.put_nowait(exc)
        finally:
            if not settled and any(received):  # no total came (closed early): the prompt, and the marks
                await self._charge_unreported(call, ledger, sum(received), prompt)
            queue.put_nowait(_DONE)

    async def _charge_unreported(self, call: Call, ledger: Ledger, received: int, prompt: int | None) -> None:
        """Charge a stream that ended without its total usage: its prompt (as the server reported it
        in a chunk, else counted as the server counts it, where it can be), and the FLOPs estimate
        and marks for the ``received`` tokens (already charged as output tokens). Runs while the
        stream's task is cancelled."""
        if prompt is None:
            prompt = 0
            with contextlib.suppress(Exception):  # counting is best effort: never fail a cancellation
                if isinstance(call.prompt, TokenIds) or self.features.tokenize or self.tokenizer is not None:
                    prompt = len(await self.tokens.prompt_ids(call.prompt))
        with contextlib.suppress(BudgetExceeded):  # unreported: no exact forward passes or FLOPs
            marks = usage_charge({"prompt_tokens": prompt, "completion_tokens": received}, self.model_params)
            marks["output_tokens"] = 0
            ledger.charge(**marks)

    # --- helpers ---------------------------------------------------------------------------------------
    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self._loop.run(coro)

    @contextlib.contextmanager
    def _timed(self, ledger: Ledger) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            _charge_time(ledger, time.perf_counter() - started)


def _eos_reason(request: Request, done: Any) -> Any:
    """A "stop" with no stop reason from the server (vLLM says null at end-of-sequence) gets the
    end-of-sequence token id, as `Completion.stop_reason` promises: with no stop string matched
    (the server would name it) and no constraint (a completed one leaves it None), the last token
    the server returned is what stopped it. Servers that return no token ids leave it None."""
    if (done.finish_reason == "stop" and done.stop_reason is None and request.constraint is None and done.token_ids):
        return dataclasses.replace(done, stop_reason=done.token_ids[-1])
    return done


def _end(queue: asyncio.Queue[Any], call: Call, finished: list[bool], reason: str) -> None:
    for i, done in enumerate(finished):
        if not done:
            queue.put_nowait(StreamChunk("", (), (), reason, None, call.first + i))


async def _next(chunks: AsyncIterator[StreamChunk]) -> StreamChunk | None:
    try:
        return await chunks.__anext__()
    except StopAsyncIteration:
        return None


def _charge_time(ledger: Ledger, seconds: float) -> None:
    with contextlib.suppress(BudgetExceeded):
        ledger.charge(seconds=seconds)

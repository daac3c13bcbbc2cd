"""The OpenAI response pieces of one HTTP call: ids, chunks, deltas, log-probabilities in the
chat and completions shapes, server-sent events, usage (`Responder`, which `metaloom.server.choices.Choices`
and then `metaloom.server.calls.Call` build on)."""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi.responses import StreamingResponse

from metaloom.generator.types import StreamChunk, TopLogprobs
from metaloom.ledger import Usage
from metaloom.meta.types import Result
from metaloom.server.errors import api_error
from metaloom.server.metrics import Metrics
from metaloom.server.tickets import Ticket

log = logging.getLogger("metaloom.server")


class Responder:
    """What every response of one call shares: its id, creation time, model, shape (chat or
    completions) and how it names tokens (``token_ids``: vLLM's exact ``token_id:N``)."""

    def __init__(self, metrics: Metrics, tokenizer: Any, *, chat: bool, model: str, logprobs: bool,
                 token_ids: bool = False) -> None:
        self.metrics, self.tokenizer = metrics, tokenizer
        self.chat, self.model, self.logprobs, self.token_ids = chat, model, logprobs, token_ids
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.started = time.perf_counter()
        self.object = "chat.completion" if chat else "text_completion"

    @property
    def _chunk_object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    def _chunk(self, index: int, delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": index, "finish_reason": finish, "logprobs": None}
        if self.chat:
            choice["delta"] = delta
        else:
            choice["text"] = delta.get("text", "")
        return {"id": self.id, "object": self._chunk_object, "created": self.created, "model": self.model,
                "choices": [choice]}

    def _usage_chunk(self, usage: Usage) -> dict[str, Any]:
        return {"id": self.id, "object": self._chunk_object, "created": self.created, "model": self.model,
                "choices": [], "usage": usage_block(usage)}

    def _delta(self, index: int, chunk: StreamChunk) -> dict[str, Any]:
        delta = ({"content": chunk.text} if chunk.text else {}) if self.chat else {"text": chunk.text}
        out = self._chunk(index, delta, chunk.finish_reason)
        choice = out["choices"][0]
        if self.logprobs and chunk.token_ids:
            choice["logprobs"] = self._logprobs(chunk.token_ids, chunk.logprobs, chunk.top_logprobs or None)
        if chunk.finish_reason is not None:
            choice["stop_reason"] = chunk.stop_reason
            if chunk.error is not None:
                choice["error"] = chunk.error
        return out

    @staticmethod
    def _ranked(pos: Any) -> list[tuple[int, float, int]]:
        """vLLM's prompt_logprobs entry: the prompt token with its rank, then the k most likely."""
        out = [(pos.token, pos.logprob, pos.rank)]
        out += [(t, lp, r) for r, (t, lp) in enumerate(pos.top, start=1) if t != pos.token]
        return out

    def _name(self, token: int) -> str:
        """A token as logprobs name it: its text, or vLLM's exact ``token_id:N``."""
        return f"token_id:{token}" if self.token_ids else self.tokenizer.decode([token])

    def _logprobs(self, ids: Sequence[int], lps: Sequence[float],
                  tops: Sequence[TopLogprobs] | None) -> dict[str, Any]:
        """OpenAI's logprobs object: chat's ``content`` list, or the completions API's parallel lists.
        ``tops``: each position's most likely tokens (None: not asked for)."""
        tokens = [self._name(t) for t in ids]
        values = [finite(lp) for lp in lps]
        alternatives = [[(self._name(t), finite(lp)) for t, lp in top] for top in tops] if tops else None
        if self.chat:
            def entry(t: str, lp: float) -> dict[str, Any]:
                return {"token": t, "logprob": lp, "bytes": list(t.encode("utf-8"))}
            return {"content": [{**entry(t, lp), "top_logprobs": [entry(*a) for a in alternatives[i]] if alternatives else []}
                                for i, (t, lp) in enumerate(zip(tokens, values, strict=True))]}
        offsets, at = [], 0
        for t in tokens:
            offsets.append(at)
            at += len(t)
        top_maps = [dict(a) for a in alternatives] if alternatives else [{} for _ in tokens]
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": top_maps, "text_offset": offsets}

    def _sse(self, events: AsyncIterator[dict[str, Any]]) -> StreamingResponse:
        async def body() -> AsyncIterator[str]:
            try:
                async for event in events:
                    yield f"data: {json.dumps(event)}\n\n"
            except Exception as exc:
                error = api_error(exc)
                if error.status >= 500 and error.status != 503:  # 503: a shutdown, not a fault
                    log.error("error while streaming", exc_info=exc)
                yield f"data: {json.dumps(error.body())}\n\n"
            yield "data: [DONE]\n\n"
            self.metrics.latency.labels("/v1/chat/completions" if self.chat else "/v1/completions").observe(
                time.perf_counter() - self.started)
        return StreamingResponse(body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    def _observe(self, usage: Usage, tickets: Sequence[Ticket]) -> None:
        self.metrics.prompt_tokens.inc(usage.input_tokens)
        self.metrics.cached_tokens.inc(usage.cached_tokens)
        self.metrics.completion_tokens.inc(usage.output_tokens)
        for t in tickets:
            if t.first_token_at is not None:
                self.metrics.ttft.observe(t.first_token_at - t.submitted)


def jsonable(value: Any) -> Any:
    """A trace event's data as strict JSON takes it: non-finite numbers become null."""
    if isinstance(value, float):
        return value if value == value and abs(value) != float("inf") else None
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    return value if value is None or isinstance(value, (str, int, bool)) else str(value)


def finite(lp: float) -> float:
    return lp if lp == lp and lp != float("-inf") else -9999.0  # strict JSON has no NaN/-inf


def finish_of(result: Result) -> str:
    if result.stopped_reason is not None:  # "budget"
        return str(result.stopped_reason)
    if result.best_index is not None and result.candidates:
        return result.candidates[result.best_index].finish_reason
    return "stop"


def usage_block(usage: Usage) -> dict[str, Any]:
    """OpenAI's usage, with the ledger's other figures under ``metaloom``."""
    extra = {k: v for k, v in usage.to_dict().items()
             if k not in ("input_tokens", "output_tokens", "cached_tokens")}
    return {"prompt_tokens": usage.input_tokens, "completion_tokens": usage.output_tokens,
            "total_tokens": usage.input_tokens + usage.output_tokens,
            "prompt_tokens_details": {"cached_tokens": usage.cached_tokens}, "metaloom": extra}

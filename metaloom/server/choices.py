"""The choices of one call's response: a completion as OpenAI's chat or completions choice
(function calls read from its text, its prompt echoed with log-probabilities), a streamed chunk
of a reply that may call functions, a strategy's answer and its progress (`Choices`, which
`metaloom.server.calls.Call` builds on)."""

from __future__ import annotations

import dataclasses
from typing import Any

from metaloom.decode.score import PromptPosition
from metaloom.generator.types import Completion, StreamChunk
from metaloom.meta.types import Result
from metaloom.server import tool_reply
from metaloom.server.metrics import Metrics
from metaloom.server.responses import Responder, finish_of, finite
from metaloom.server.strategy import StrategyCall
from metaloom.server.tickets import Ticket


class Choices(Responder):
    """`Responder` with what shapes this call's choices: its prompts (``echo``,
    ``prompt_logprobs``), whether replies are read for function calls, and the tickets whose
    rows a reply that repeats its calls ends."""

    def __init__(self, metrics: Metrics, tokenizer: Any, *, chat: bool, model: str, logprobs: bool,
                 token_ids: bool = False) -> None:
        super().__init__(metrics, tokenizer, chat=chat, model=model, logprobs=logprobs, token_ids=token_ids)
        self.prompts: list[Prompted] | None = None  # per request, when echo or prompt_logprobs asked for them
        self.echo = False
        self.tools = False  # replies are read for function calls (`metaloom.server.tools`)
        self.streams: dict[int, tool_reply.ToolStream] = {}  # with tools: each choice's reader of its calls
        self.tickets: list[Ticket] = []
        self.n = 1

    def _progress(self, call: StrategyCall, tally: dict[str, Any]) -> dict[str, Any]:
        return {"id": self.id, "object": self._chunk_object, "created": self.created, "model": self.model,
                "choices": [], "metaloom": {"event": "progress", "strategy": call.name, **tally}}

    def _tool_deltas(self, index: int, chunk: StreamChunk) -> list[dict[str, Any]]:
        """A streamed chunk of a choice whose reply may call functions: OpenAI's deltas (content,
        each call's id and name, its arguments in pieces), the chunk's log-probabilities on the
        first, the finish reason (``tool_calls`` for a reply that called) on the last."""
        stream = self._read_calls(index, chunk.text)
        deltas = stream.deltas
        if chunk.finish_reason is not None:
            deltas += stream.finish()
        outs = [self._chunk(index, d) for d in deltas] or [self._chunk(index, {})]
        if self.logprobs and chunk.token_ids:
            outs[0]["choices"][0]["logprobs"] = self._logprobs(chunk.token_ids, chunk.logprobs, chunk.top_logprobs or None)
        if chunk.finish_reason is not None:
            last = outs[-1]["choices"][0]
            last["finish_reason"] = tool_reply.finish_reason(stream.text, chunk.finish_reason)
            last["stop_reason"] = chunk.stop_reason
            if chunk.error is not None:
                last["error"] = chunk.error
        return outs

    def _read_calls(self, index: int, text: str) -> tool_reply.ToolStream:
        """Feed choice ``index``'s reader (its new deltas in ``.deltas``); a reply that began
        repeating a call it made has its row ended (greedy models repeat until max_tokens)."""
        stream = self.streams.setdefault(index, tool_reply.ToolStream())
        stream.deltas = stream.feed(text)
        if stream.repeated and self.tickets:
            self.tickets[index // self.n].end_row(index % self.n)
        return stream

    def _choice(self, index: int, c: Completion, request: int = 0) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": index, "finish_reason": c.finish_reason,
                                  "stop_reason": c.stop_reason,
                                  "logprobs": self._logprobs(c.token_ids, c.logprobs, c.top_logprobs) if self.logprobs else None}
        if self.chat and self.tools:
            choice["message"], _ = tool_reply.message(c.text)
            choice["finish_reason"] = tool_reply.finish_reason(c.text, c.finish_reason)
        elif self.chat:
            choice["message"] = {"role": "assistant", "content": c.text}
        else:
            choice["text"] = c.text
            if self.prompts is not None:
                self._decorate(choice, request, c)
        if c.error is not None:
            choice["error"] = c.error
        return choice

    def _decorate(self, choice: dict[str, Any], request: int, c: Completion) -> None:
        """A completions choice with its prompt: echoed before the text (and its log-probabilities
        before the text's), and vLLM's ``prompt_logprobs``."""
        assert self.prompts is not None
        p = self.prompts[request]
        if p.positions is not None:
            choice["prompt_logprobs"] = [None, *({str(t): {"logprob": finite(lp), "rank": rank, "decoded_token": self._name(t)}
                                                  for t, lp, rank in self._ranked(pos)} for pos in p.positions)]
        if not self.echo:
            return
        choice["text"] = p.text + choice["text"]
        if self.logprobs and p.positions is not None:
            head = self._logprobs(p.ids[1:], [q.logprob for q in p.positions], [q.top for q in p.positions])
            first = self._name(p.ids[0])
            tail = choice["logprobs"] or {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
            shift = len(first) + sum(len(t) for t in head["tokens"])
            choice["logprobs"] = {
                "tokens": [first, *head["tokens"], *tail["tokens"]],
                "token_logprobs": [None, *head["token_logprobs"], *tail["token_logprobs"]],
                "top_logprobs": [None, *head["top_logprobs"], *tail["top_logprobs"]],
                "text_offset": [0, *(len(first) + o for o in head["text_offset"]), *(shift + o for o in tail["text_offset"])],
            }

    def _strategy_choice(self, result: Result) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish_of(result), "logprobs": None}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": result.best}
        else:
            choice["text"] = result.best
        return choice


@dataclasses.dataclass(frozen=True)
class Prompted:
    """A completions prompt as echo and prompt_logprobs report it; ``positions``: its tokens'
    log-probabilities from the second on (None: not asked for)."""

    text: str
    ids: list[int]
    positions: list[PromptPosition] | None

"""Token ids, chat-template text and scoring for `RemoteGenerator`: from the server's own
/tokenize and /detokenize where it has them (what it reads is what it generates from), else
from a local tokenizer.

Scoring sends prompt + continuation as one token-id prompt and reads the log-probabilities the
server gives the prompt's tokens (``echo`` with ``max_tokens: 0`` where the server scores without
generating, else vLLM's ``prompt_logprobs``, else ``echo`` with ``logprobs``) from where the
continuation starts; all continuations, of one prompt or of several, go in one batched request.
"""

from __future__ import annotations

import asyncio
import math
import os
from collections.abc import Callable, Sequence
from typing import Any

from metaloom.errors import InvalidParameter, RemoteError
from metaloom.generator.remote.detect import ServerFeatures
from metaloom.generator.remote.transport import Json, Malformed, Transport
from metaloom.generator.remote.wire import choices_of, logprob_entries
from metaloom.generator.types import Message, Prompt, Scored, TokenIds


class Tokens:
    """Tokenisation as the server does it (``features`` says which routes it has), with
    ``tokenizer`` (any object with ``encode``, ``decode``, ``apply_chat_template``) for the rest."""

    def __init__(self, transport: Transport, model: str, features: ServerFeatures, tokenizer: Any) -> None:
        self.t, self.model, self.f, self.tokenizer = transport, model, features, tokenizer

    async def prompt_ids(self, prompt: Prompt) -> list[int]:
        """A prompt's ids as the server encodes it: text with special tokens, a chat through its
        template (the generation prompt added), token ids as given."""
        if isinstance(prompt, TokenIds):
            return list(prompt.ids)
        if isinstance(prompt, str):
            ids = await self.tokenize(prompt, True)
        elif self.f.tokenize_chat:
            ids = _ints(await self.t.post("/tokenize", {"model": self.model, "messages": [dict(m) for m in prompt],
                                                        "add_generation_prompt": True}))
        else:
            tok = self._local()
            ids = tok.encode(tok.apply_chat_template(list(prompt)), add_special_tokens=False)
        if not ids:
            raise InvalidParameter("prompt", prompt, "text that encodes to at least one token")
        return list(ids)

    async def tokenize(self, text: str, special: bool) -> list[int]:
        if self.f.tokenize:
            return _ints(await self.t.post("/tokenize", {"model": self.model, "prompt": text, "add_special_tokens": special}))
        return list(self._local().encode(text, add_special_tokens=special))

    async def render(self, messages: Sequence[Message]) -> str:
        if self.f.tokenize_chat and self.f.detokenize:  # the server's own template is the one it generates from
            return await self.decode(await self.prompt_ids(tuple(messages)))
        return str(self._local().apply_chat_template(list(messages)))

    async def decode(self, ids: Sequence[int]) -> str:
        if self.f.detokenize:
            data = await self.t.post("/detokenize", {"model": self.model, "tokens": list(ids)}, _text_answer)
            return str(data["prompt"])
        return str(self.tokenizer.decode(list(ids))) if self.tokenizer is not None else ""

    def local_encode(self, special: bool) -> Callable[[str], Sequence[int]] | None:
        tok = self.tokenizer
        return None if tok is None else (lambda text: tok.encode(text, add_special_tokens=special))

    def _local(self) -> Any:
        if self.tokenizer is None:  # the capabilities refuse what needs one before this is reached
            raise RuntimeError("no local tokenizer")
        return self.tokenizer

    # --- scoring ------------------------------------------------------------------------------------
    async def score_many(self, items: Sequence[tuple[Prompt, Sequence[str | TokenIds]]]) -> tuple[list[list[Scored]], Json]:
        """Each prompt's continuations scored, all in one request (a server that shares what its
        prompts have in common, as metaloom serve does, computes each shared beginning once), and
        the server's answer. Where the server scores without generating (``echo`` with
        ``max_tokens: 0``), nothing is generated: a generated token would cost a prefill per prompt."""
        prepared = await asyncio.gather(*(self._prepare(p, cs) for p, cs in items))
        rows = [(context, ids) for context, conts in prepared for ids in conts]
        body: Json = {"model": self.model, "prompt": [context + ids for context, ids in rows], "temperature": 0.0}
        if self.f.score_only:
            body.update({"echo": True, "logprobs": 0, "max_tokens": 0})
        else:
            body.update({"prompt_logprobs": 0} if self.f.prompt_logprobs else {"echo": True, "logprobs": 0})
            body["max_tokens"] = 1
        data = await self.t.post("completions", body, expect_choices(len(rows)))
        flat = []
        for c, (context, ids), choice in zip([c for _, cs in items for c in cs], rows, choices_of(data, len(rows)), strict=True):
            lps = prompt_logprobs(choice, context + ids)[len(context):]
            if len(lps) != len(ids) or any(math.isnan(v) for v in lps):
                raise RemoteError(self.t.url("completions"), "prompt log-probabilities missing for the continuation")
            flat.append(Scored(c if isinstance(c, str) else await self.decode(c.ids), tuple(ids), tuple(lps)))
        out, start = [], 0
        for _, cs in items:
            out.append(flat[start:start + len(cs)])
            start += len(cs)
        return out, data

    async def _prepare(self, prompt: Prompt, continuations: Sequence[str | TokenIds]) -> tuple[list[int], list[list[int]]]:
        """(the prompt's ids, each continuation's ids after it)."""
        context = await self.prompt_ids(prompt)
        text: str | None = None  # the context as text, where the continuation can be cut from the whole
        if isinstance(prompt, str):
            text = prompt
        elif isinstance(prompt, tuple):
            text = await self.render(prompt)
        conts = await asyncio.gather(*(self.continuation(text, context, c, isinstance(prompt, str)) for c in continuations))
        return context, list(conts)

    async def continuation(self, context_text: str | None, context: list[int], c: str | TokenIds, special: bool) -> list[int]:
        """The ids ``c`` has after the context: what the whole text has after the context's ids,
        or its own encoding where a token crosses the boundary (as the local engine cuts it,
        `metaloom.decode.score.split_continuation`)."""
        if isinstance(c, TokenIds):
            return list(c.ids)
        if context_text is not None:
            ctx, whole = await asyncio.gather(self.tokenize(context_text, special), self.tokenize(context_text + c, special))
            if ctx == context and whole[:len(ctx)] == ctx and len(whole) > len(ctx):
                return whole[len(ctx):]
        ids = await self.tokenize(c, False)
        if not ids:
            raise InvalidParameter("continuation", c, "text that encodes to at least one token")
        return ids


def prompt_logprobs(choice: Json, ids: Sequence[int]) -> list[float]:
    """log p(ids[k] | ids[:k]) per position (NaN where unknown): vLLM's ``prompt_logprobs``
    (one {token id: {logprob}} map per position), else the echoed ``logprobs``."""
    entries = choice.get("prompt_logprobs")
    if isinstance(entries, list):
        out = []
        for k, entry in enumerate(entries[:len(ids)]):
            found = entry.get(str(ids[k])) if isinstance(entry, dict) else None
            value = found.get("logprob") if isinstance(found, dict) else found
            out.append(float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else math.nan)
        return out
    return logprob_entries(choice.get("logprobs"), False)[1][:len(ids)]


def expect_choices(n: int) -> Callable[[Json], None]:
    """A shape check for a completion answer with ``n`` choices (a wrong one is retried as unreadable)."""
    def check(data: Json) -> None:
        try:
            choices_of(data, n)
        except ValueError as exc:
            raise Malformed(str(exc)) from exc
    return check


def _text_answer(data: Json) -> None:
    if not isinstance(data.get("prompt"), str):
        raise Malformed("no prompt text in the /detokenize answer")


def _ints(data: Json) -> list[int]:
    tokens = data.get("tokens")
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise RemoteError("/tokenize", f"no token ids in the answer: {str(data)[:200]}")
    return tokens


def load_tokenizer(tokenizer: Any) -> Any:
    """A tokenizer object as given, or one loaded from a tokenizer folder."""
    if tokenizer is None or not isinstance(tokenizer, (str, os.PathLike)):
        if tokenizer is not None and not all(hasattr(tokenizer, a) for a in ("encode", "decode", "apply_chat_template")):
            raise InvalidParameter("tokenizer", tokenizer, "a tokenizer folder or an object with encode, decode and "
                                   "apply_chat_template")
        return tokenizer
    from metaloom.models.engine.tokenizer import HFTokenizer  # only here: it brings torch in with metaloom.models

    return HFTokenizer(os.fspath(tokenizer))

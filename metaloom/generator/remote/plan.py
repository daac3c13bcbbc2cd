"""From a `Request` to the HTTP requests that serve it, before anything is sent: what this
server cannot serve is refused with `Unsupported` (`check`), and the rest becomes one request
per ``n`` samples, or ``n`` requests of one sample each where the server ignores ``n``
(`calls`), each a `Call` whose body carries the sampling, constraint and log-probability fields
the server was found to take (`ServerFeatures`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from metaloom.errors import InvalidParameter, Unsupported
from metaloom.generator.remote.detect import ServerFeatures
from metaloom.generator.remote.tokens import Tokens
from metaloom.generator.remote.transport import Json
from metaloom.generator.remote.wire import constraint_body, sampling_body
from metaloom.generator.types import Prompt, Request, TokenIds

if TYPE_CHECKING:
    from metaloom.generator.capabilities import Capabilities


@dataclass(frozen=True)
class Call:
    """One HTTP request of a `Request`: samples ``first`` .. ``first + n - 1`` of it."""

    path: str  # "completions" or "chat/completions"
    body: Json
    first: int
    n: int
    prompt: Prompt  # as sent (token ids where a prefix was added), to count a cancelled stream's prompt
    top: int = 0  # alternatives per position asked for
    copies: int = 1  # greedy n > 1: one sample stands for ``copies`` identical ones (vLLM refuses n > 1 greedy)

    @property
    def samples(self) -> int:
        return self.n * self.copies

    @property
    def chat(self) -> bool:
        return self.path == "chat/completions"


def check(request: Request, features: ServerFeatures, capabilities: Capabilities, name: str,
          has_tokenizer: bool) -> None:
    """Raise `Unsupported` for anything about ``request`` the server ``name`` cannot serve."""
    if not isinstance(request, Request):
        raise InvalidParameter("request", request, "a metaloom.generator.Request")
    capabilities.check(request, name)
    f, p = features, request.params
    chat = isinstance(request.prompt, tuple) and not request.prefix
    if chat and not f.chat:
        raise Unsupported("chat prompts", name, "the server has no /v1/chat/completions")
    if not chat and not f.completions:
        raise Unsupported("text and token-id prompts", name, "the server has no /v1/completions")
    if request.constraint is not None and not (f.guided or f.structured_outputs) and not chat:
        raise Unsupported(f"constraint {request.constraint.kind} on a text prompt", name,
                          "the server constrains chat answers only (response_format)")
    if request.prefix:
        if {"presence_frequency", "no_repeat_ngram"} & p.adapters:
            raise Unsupported("prefix with presence/frequency or n-gram penalties", name,
                              "the server would count the prefix as prompt, not as output")
        if request.constraint is not None:
            raise Unsupported("prefix with a constraint", name, "the server would constrain only what follows it")
        if isinstance(request.prompt, tuple):
            require_chat_tokens("prefix", features, name, has_tokenizer)


def require_chat_tokens(what: str, features: ServerFeatures, name: str, has_tokenizer: bool) -> None:
    """``what`` after a chat prompt needs the chat's token ids: the server's /tokenize for chats
    or a local tokenizer."""
    if not (features.tokenize_chat or has_tokenizer):
        raise Unsupported(f"{what} after a chat prompt", name, "needs the server's /tokenize for chats or a tokenizer")


async def calls(request: Request, model: str, features: ServerFeatures, tokens: Tokens) -> list[Call]:
    """The HTTP requests that serve ``request``: one (``n`` samples), or ``n`` concurrent
    ones where the server ignores ``n`` (sample i then gets seed + i, so they differ)."""
    f, p = features, request.params
    body: Json = {"model": model, **sampling_body(p, f.extras)}
    if request.constraint is not None:
        body.update(constraint_body(request.constraint, f.guided, f.structured_outputs))
    prompt = request.prompt
    if isinstance(prompt, tuple) and not request.prefix:
        path = "chat/completions"
        body["messages"] = [dict(m) for m in prompt]
    else:
        path = "completions"
        if isinstance(prompt, str) and not request.prefix:
            body["prompt"] = prompt
        else:
            prompt = TokenIds((*(await tokens.prompt_ids(prompt)), *request.prefix))
            body["prompt"] = list(prompt.ids)
    if f.chat_logprobs if path == "chat/completions" else f.logprobs:
        body["logprobs"] = True if path == "chat/completions" else p.top_logprobs
        if p.top_logprobs and path == "chat/completions":
            body["top_logprobs"] = p.top_logprobs
        if f.token_ids:
            body["return_tokens_as_token_ids"] = True
    if p.greedy and p.n > 1:  # n identical samples: ask once (what the server computes is what is charged)
        return [Call(path, _seeded(body, 1, p.seed), 0, 1, prompt, p.top_logprobs, copies=p.n)]
    if f.n or p.n == 1:
        return [Call(path, _seeded(body, p.n, p.seed), 0, p.n, prompt, p.top_logprobs)]
    return [Call(path, _seeded(body, 1, None if p.seed is None else p.seed + i), i, 1, prompt, p.top_logprobs)
            for i in range(p.n)]


def _seeded(body: Json, n: int, seed: int | None) -> Json:
    out = dict(body)
    if n > 1:
        out["n"] = n
    if seed is not None:
        out["seed"] = seed
    return out

"""What a server can do, found at start-up with a few one-token requests (`detect`), and the
`Capabilities` that follow (`capabilities`).

"Accepted" is not "honoured": vLLM and llama.cpp's server ignore fields they do not know
(with a warning in their log). So every feature whose effect shows in the answer is checked
there — ``n`` (that many choices), log-probabilities (present), token ids (vLLM's
"token_id:N" tokens), prompt log-probabilities, echo, guided choice (the text is a choice),
JSON response_format (the text opens an object), continuous usage (usage in every chunk). A
sampling field's effect does not show in one token, so it counts as served only where the
server refuses unknown fields (a probe field finds out), and on a lenient server only vLLM's
documented extras (``top_k``, ``min_p``, ``repetition_penalty``, ``ignore_eos``,
``include_stop_str_in_output``).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from metaloom.constrain.spec import KINDS as CONSTRAINT_KINDS
from metaloom.errors import InvalidParameter, RemoteError, ServerUnreachable
from metaloom.generator.capabilities import SAMPLING_FIELDS, Capabilities
from metaloom.generator.remote.transport import Json, Transport
from metaloom.generator.remote.wire import OPENAI_SAMPLING, choices_of, logprob_entries, token_ids, top_entries
from metaloom.sampling.params import PROBES

PROBE_TEXT = "hello"  # plain lowercase letters: a valid prompt even for a toy character vocabulary
VLLM_EXTRAS = frozenset({"top_k", "min_p", "repetition_penalty", "ignore_eos", "include_stop_str_in_output"})
# a valid, non-default value for every sampling field beyond OpenAI's (probed at temperature 0.5),
# declared with the field (`metaloom.sampling.knobs`)
PROBE_VALUES: dict[str, Any] = PROBES
# probed one by one (a field added to SamplingParams later, with no probe value, counts as not served)
EXTRA_SAMPLING = frozenset(PROBE_VALUES) & SAMPLING_FIELDS


@dataclass(frozen=True)
class ServerFeatures:
    """What the server was found to honour. ``completions`` / ``chat``: the two routes;
    ``strict``: unknown fields are refused (so an accepted field is a served one); ``extras``:
    sampling fields beyond OpenAI's, under their own names; ``token_ids``: vLLM's
    ``return_tokens_as_token_ids``; ``token_prompts``: /v1/completions takes token-id prompts;
    ``top_logprobs``: the most likely tokens per position, by token id; ``score_only``: ``echo``
    with ``max_tokens: 0`` scores prompts without generating; ``guided``: vLLM's
    ``guided_*`` constraints; ``response_format``: OpenAI's JSON Schema
    output (chat); ``continuous_usage``: vLLM's usage in every stream chunk; ``tokenize`` /
    ``tokenize_chat`` / ``detokenize``: vLLM's routes; ``exact_usage``: metaloom's usage block
    (exact forward passes and FLOPs)."""

    completions: bool = False
    chat: bool = False
    strict: bool = False
    n: bool = False
    logprobs: bool = False
    chat_logprobs: bool = False
    seed: bool = False
    extras: frozenset[str] = frozenset()
    token_ids: bool = False
    top_logprobs: bool = False
    prompt_logprobs: bool = False
    echo: bool = False
    score_only: bool = False  # echo with max_tokens 0: the prompt scored, nothing generated (OpenAI's scoring call)
    token_prompts: bool = False
    guided: bool = False
    structured_outputs: bool = False  # vLLM >= 0.11's ``structured_outputs`` object (the ``guided_*`` fields are gone)
    response_format: bool = False
    stream: bool = False
    continuous_usage: bool = False
    tokenize: bool = False
    tokenize_chat: bool = False
    detokenize: bool = False
    exact_usage: bool = False


def capabilities(f: ServerFeatures, local_tokenizer: bool) -> Capabilities:
    """The `Capabilities` a server with features ``f`` gives (a local tokenizer fills in
    token ids, tokenisation and the chat template where the server has no route for them)."""
    sampling = OPENAI_SAMPLING | ({"seed"} if f.seed else frozenset()) | ({"top_logprobs"} if f.top_logprobs else frozenset()) \
        | f.extras
    constraints = (frozenset(CONSTRAINT_KINDS) if f.guided or f.structured_outputs
                   else frozenset({"json_schema"} if f.response_format else ()))
    tokenizes = f.tokenize or local_tokenizer
    logprobs = (f.logprobs or not f.completions) and (f.chat_logprobs or not f.chat)
    wanted = {
        "token_ids": f.token_ids or local_tokenizer,
        "logprobs": logprobs,
        "score": f.token_prompts and (f.prompt_logprobs or f.echo) and tokenizes,
        "render": (f.tokenize_chat and f.detokenize) or local_tokenizer,
        "stream": f.stream,
        "token_prompts": f.token_prompts,
        "prefix": f.token_prompts and tokenizes,
    }
    return Capabilities(sampling=frozenset(sampling), decoders=frozenset(), constraints=constraints,
                        features=frozenset(name for name, on in wanted.items() if on), max_n=None)


class Prober:
    """The probes of one detection run (each a small request whose answer says what it found)."""

    def __init__(self, transport: Transport, model: str, local_ids: Callable[[str], Sequence[int]] | None) -> None:
        self.t, self.model, self.local_ids = transport, model, local_ids
        self.exact_usage = False

    async def accepts(self, path: str, body: Json, *, required: bool = False) -> Json | None:
        """The answer, or None where the server refuses the request (a 4xx). A feature probe
        (not ``required``) that fails otherwise — a 5xx after retries, a timeout — also means
        "not served": a feature that breaks the server is not one to use. A server that cannot
        be reached (`ServerUnreachable`: down, or gone mid-probe) is that error, never a feature
        it lacks."""
        try:
            data = await self.t.post(path, body)
        except ServerUnreachable:
            raise
        except RemoteError as exc:
            if not required or (exc.status is not None and 400 <= exc.status < 500):
                return None
            raise
        usage = data.get("usage")
        if isinstance(usage, dict) and isinstance(usage.get("metaloom"), dict):
            self.exact_usage = True
        return data

    async def check_model(self) -> None:
        data = await self.t.get("models")
        listed = data.get("data")
        ids = [m.get("id") for m in listed if isinstance(m, dict)] if isinstance(listed, list) else []
        if self.model not in ids:
            shown = ", ".join(map(str, ids[:20])) + (" ..." if len(ids) > 20 else "")
            raise InvalidParameter("model", self.model, f"a model the server at {self.t.api_url} serves: {shown or 'none'}")

    async def groups(self, path: str, base: Json, groups: dict[str, Json]) -> dict[str, Json]:
        """name -> an answer to a request with that group's fields: all groups at once, then
        halves of a refused set, so k refused groups among g cost about 2·k·log2(g) requests."""
        if not groups:
            return {}
        body = dict(base)
        for fields in groups.values():
            body.update(fields)
        data = await self.accepts(path, body)
        if data is not None:
            return dict.fromkeys(groups, data)
        if len(groups) == 1:
            return {}
        names = sorted(groups)
        half = len(names) // 2
        left, right = await asyncio.gather(self.groups(path, base, {k: groups[k] for k in names[:half]}),
                                           self.groups(path, base, {k: groups[k] for k in names[half:]}))
        return {**left, **right}

    async def stream(self, path: str, body: Json) -> tuple[bool, bool]:
        """(streams, reports usage in every chunk)."""
        for options in ({"include_usage": True, "continuous_usage_stats": True}, {"include_usage": True}):
            try:
                async with contextlib.aclosing(self.t.events(path, {**body, "max_tokens": 2, "stream": True,
                                                                    "stream_options": options})) as stream:
                    events = [e async for e in stream]
            except ServerUnreachable:  # the server is gone, not the feature
                raise
            except RemoteError:  # refused (or broken) with these options
                continue
            continuous = any(e.get("choices") and isinstance(e.get("usage"), dict) for e in events)
            return True, continuous and "continuous_usage_stats" in options
        return False, False

    async def tokenize(self) -> tuple[list[int] | None, bool, bool]:
        """(ids of the probe text via /tokenize, chat tokenisation works, /detokenize works)."""
        text = await self.accepts("/tokenize", {"model": self.model, "prompt": PROBE_TEXT})
        ids = _ints(text.get("tokens")) if text is not None else None
        chat = await self.accepts("/tokenize", {"model": self.model, "add_generation_prompt": True,
                                                "messages": [{"role": "user", "content": PROBE_TEXT}]})
        chat_ids = _ints(chat.get("tokens")) if chat is not None else None
        back = await self.accepts("/detokenize", {"model": self.model, "tokens": chat_ids or ids}) if (chat_ids or ids) else None
        return ids, chat_ids is not None, back is not None and isinstance(back.get("prompt"), str)


def _ints(value: object) -> list[int] | None:
    if isinstance(value, list) and value and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return value
    return None


def _choice(data: Json | None) -> Json:
    if data is None:
        return {}
    try:
        return choices_of(data)[0]
    except (ValueError, IndexError):
        return {}


async def detect(t: Transport, model: str, local_ids: Callable[[str], Sequence[int]] | None = None) -> ServerFeatures:
    """Probe the server behind ``t`` for ``model`` (see the module docstring). Raises
    `InvalidParameter` naming the model when the server does not list it, `ServerUnreachable`
    when it cannot be reached (at the start or mid-probe), `RemoteError` when it serves neither
    completion route or fails."""
    p = Prober(t, model, local_ids)
    await p.check_model()
    text_body: Json = {"model": model, "prompt": PROBE_TEXT, "max_tokens": 1, "temperature": 0.5}
    chat_body: Json = {"model": model, "messages": [{"role": "user", "content": PROBE_TEXT}], "max_tokens": 1,
                       "temperature": 0.5}
    completions, chat = await asyncio.gather(p.accepts("completions", text_body, required=True),
                                             p.accepts("chat/completions", chat_body, required=True))
    if completions is None and chat is None:
        raise RemoteError(t.api_url, f"serves neither /completions nor /chat/completions for model {model!r}")
    path, base = ("completions", text_body) if completions is not None else ("chat/completions", chat_body)
    is_chat = completions is None
    strict = await p.accepts(path, {**base, "metaloom_probe_unknown_field": 1}) is None
    found, routes, streams, tokenized = await asyncio.gather(
        p.groups(path, base, _groups(is_chat, strict)), _route_features(p, completions, chat, text_body, chat_body),
        p.stream(path, base), p.tokenize())
    ids, tokenize_chat, detokenize = tokenized
    features = _read_groups(found, is_chat)
    generated_ids = features.pop("_ids")  # a token the server itself produced: a valid id, if nothing else is known
    probe_ids = ids or (list(local_ids(PROBE_TEXT)) if local_ids is not None else None) or generated_ids
    token_prompts = completions is not None and bool(probe_ids) and \
        await p.accepts("completions", {**text_body, "prompt": probe_ids}) is not None
    return ServerFeatures(completions=completions is not None, chat=chat is not None, strict=strict, **features, **routes,
                          stream=streams[0], continuous_usage=streams[1], tokenize=ids is not None,
                          tokenize_chat=tokenize_chat, detokenize=detokenize, token_prompts=token_prompts,
                          exact_usage=p.exact_usage)


def _groups(chat: bool, strict: bool) -> dict[str, Json]:
    logprobs: Json = {"logprobs": True} if chat else {"logprobs": 0}
    groups: dict[str, Json] = {"n": {"n": 2}, "logprobs": logprobs, "seed": {"seed": 0},
                               "token_ids": {"return_tokens_as_token_ids": True, **logprobs},
                               "top_logprobs": {"return_tokens_as_token_ids": True,
                                                **({"logprobs": True, "top_logprobs": 2} if chat else {"logprobs": 2})}}
    if not chat:
        groups["prompt_logprobs"] = {"prompt_logprobs": 0}
    for name in sorted(EXTRA_SAMPLING if strict else VLLM_EXTRAS):
        groups[f"extra:{name}"] = {name: PROBE_VALUES[name]}
    return groups


def _read_groups(found: dict[str, Json], chat: bool) -> dict[str, Any]:
    """Feature flags from the probe answers (each checked for its effect where it shows)."""
    def entries(name: str) -> tuple[list[str], list[float]]:
        return logprob_entries(_choice(found.get(name)).get("logprobs"), chat)

    n_data = found.get("n")
    ids = token_ids(entries("token_ids")[0])
    prompt_lps = _choice(found.get("prompt_logprobs")).get("prompt_logprobs")
    tops = top_entries(_choice(found.get("top_logprobs")).get("logprobs"), chat, 2)
    out: dict[str, Any] = {
        "n": n_data is not None and len(n_data.get("choices") or []) == 2,
        "logprobs": not chat and bool(entries("logprobs")[1]),
        "seed": "seed" in found,
        "extras": frozenset(k.removeprefix("extra:") for k in found if k.startswith("extra:")),
        "token_ids": ids is not None,
        "top_logprobs": bool(tops) and all(tops or ()),  # alternatives, named by id, at every position
        "prompt_logprobs": isinstance(prompt_lps, list) and len(prompt_lps) > 0,
        "_ids": list(ids) if ids else None,
    }
    if chat:
        out["chat_logprobs"] = bool(entries("logprobs")[1])
    return out


async def _route_features(p: Prober, completions: Json | None, chat: Json | None, text_body: Json,
                          chat_body: Json) -> dict[str, Any]:
    """Chat log-probabilities (when completions is the primary route), echo, and constraints."""
    jobs: dict[str, Awaitable[Json | None]] = {}
    if completions is not None:
        jobs["echo"] = p.accepts("completions", {**text_body, "echo": True, "logprobs": 0})
        jobs["score_only"] = p.accepts("completions", {**text_body, "echo": True, "logprobs": 0, "max_tokens": 0})
        jobs["guided"] = p.accepts("completions", {**text_body, "temperature": 0.0, "max_tokens": 4,
                                                   "guided_choice": ["yes", "no"]})
        jobs["structured_outputs"] = p.accepts("completions", {**text_body, "temperature": 0.0, "max_tokens": 4,
                                                               "structured_outputs": {"choice": ["yes", "no"]}})
    if chat is not None:
        if completions is not None:
            jobs["chat_logprobs"] = p.accepts("chat/completions", {**chat_body, "logprobs": True})
        else:
            jobs["guided"] = p.accepts("chat/completions", {**chat_body, "temperature": 0.0, "max_tokens": 4,
                                                            "guided_choice": ["yes", "no"]})
            jobs["structured_outputs"] = p.accepts("chat/completions", {
                **chat_body, "temperature": 0.0, "max_tokens": 4, "structured_outputs": {"choice": ["yes", "no"]}})
        jobs["response_format"] = p.accepts("chat/completions", {**chat_body, "temperature": 0.0, "max_tokens": 8,
                                                                 "response_format": _PROBE_FORMAT})
    answers = dict(zip(jobs, await asyncio.gather(*jobs.values()), strict=True))
    out: dict[str, Any] = {}
    if "echo" in answers:
        echo = _choice(answers["echo"])
        _, lps = logprob_entries(echo.get("logprobs"), False)
        out["echo"] = str(echo.get("text", "")).startswith(PROBE_TEXT) and len(lps) >= 2
    if "score_only" in answers:  # the prompt back with its log-probabilities, nothing generated
        only, usage = _choice(answers["score_only"]), (answers["score_only"] or {}).get("usage")
        generated = usage.get("completion_tokens") if isinstance(usage, dict) else 0
        out["score_only"] = only.get("text") == PROBE_TEXT and bool(logprob_entries(only.get("logprobs"), False)[1]) \
            and generated == 0
    if "chat_logprobs" in answers:
        out["chat_logprobs"] = bool(logprob_entries(_choice(answers["chat_logprobs"]).get("logprobs"), True)[1])
    for name in ("guided", "structured_outputs"):  # honoured only if the answer is one of the choices
        got = _choice(answers.get(name))
        text = got.get("text") if "text" in got else (got.get("message") or {}).get("content")
        out[name] = isinstance(text, str) and text.strip() in ("yes", "no")
    fmt = (_choice(answers.get("response_format")).get("message") or {}).get("content")
    out["response_format"] = isinstance(fmt, str) and fmt.lstrip().startswith("{")
    return out


_PROBE_FORMAT = {"type": "json_schema", "json_schema": {"name": "probe", "strict": True, "schema": {
    "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False}}}


"""metaloom's requests and results in the OpenAI / vLLM wire format, both ways: plain functions
over JSON dicts, no I/O.

Names beyond OpenAI's are vLLM's (``top_k``, ``min_p``, ``repetition_penalty``, ``ignore_eos``,
``include_stop_str_in_output``, ``guided_json`` / ``guided_regex`` / ``guided_choice`` /
``guided_grammar``, ``return_tokens_as_token_ids``, ``prompt_logprobs``), which llama.cpp's
server and metaloom's own share for the sampling fields they have.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

from metaloom.constrain.spec import ConstraintSpec
from metaloom.generator.types import Completion, StreamChunk, TopLogprobs
from metaloom.sampling.params import SamplingParams

Json = dict[str, Any]
Encode = Callable[[str], Sequence[int]]

DEFAULTS = SamplingParams()
# sampling fields every OpenAI-compatible server takes (n is served even where it is not: as
# concurrent requests)
OPENAI_SAMPLING = frozenset({"temperature", "top_p", "max_tokens", "n", "stop", "presence_penalty", "frequency_penalty",
                             "logit_bias"})
TOKEN_ID = "token_id:"  # vLLM's token text under return_tokens_as_token_ids

# finish reasons as metaloom names them (`metaloom.generator.types.FINISH_REASONS`); vLLM says
# "abort" for a request it dropped
FINISH = {"stop": "stop", "length": "length", "budget": "budget", "error": "error", "cancelled": "cancelled",
          "abort": "cancelled"}


# --- requests -----------------------------------------------------------------------------------
def sampling_body(p: SamplingParams, extras: frozenset[str]) -> Json:
    """The body fields of ``p`` except ``n`` and ``seed`` (the caller sets those per call).
    Temperature, top-p and max_tokens are always sent: a server may otherwise apply its model's
    own generation defaults. Other fields only when set, so a server that lacks one is not sent it."""
    body: Json = {"temperature": p.temperature, "top_p": p.top_p, "max_tokens": p.max_tokens}
    if p.stop:
        body["stop"] = list(p.stop)
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(p, name):
            body[name] = getattr(p, name)
    if p.logit_bias:
        body["logit_bias"] = {str(token): bias for token, bias in p.logit_bias.items()}
    for name in sorted(extras):
        value = getattr(p, name)
        if value != getattr(DEFAULTS, name):
            body[name] = list(value) if isinstance(value, tuple) else value
    return body


def constraint_body(spec: ConstraintSpec, guided: bool, structured: bool = False) -> Json:
    """vLLM's ``structured_outputs`` object (``structured``: vLLM >= 0.11), its older ``guided_*``
    fields (``guided``), or OpenAI's ``response_format`` (JSON Schema only)."""
    source = spec.source
    if structured:
        key = {"json_schema": "json", "regex": "regex", "choices": "choice", "lark": "grammar"}[spec.kind]
        value: Any = json.loads(source) if spec.kind == "json_schema" and isinstance(source, str) else source
        return {"structured_outputs": {key: list(value) if spec.kind == "choices" else value}}
    if not guided:
        assert spec.kind == "json_schema" and isinstance(source, str)
        return {"response_format": {"type": "json_schema",
                                    "json_schema": {"name": "response", "schema": json.loads(source), "strict": True}}}
    if spec.kind == "json_schema":
        assert isinstance(source, str)
        return {"guided_json": json.loads(source)}
    if spec.kind == "regex":
        return {"guided_regex": source}
    if spec.kind == "choices":
        return {"guided_choice": list(source)}
    return {"guided_grammar": source}  # lark: the server's grammar engine must read Lark (vLLM's guidance backend does)


# --- results --------------------------------------------------------------------------------------
def logprob_entries(logprobs: object, chat: bool) -> tuple[list[str], list[float]]:
    """(token texts, log-probabilities) of a choice's ``logprobs`` (chat: ``content`` entries;
    completions: ``tokens`` / ``token_logprobs``). A null log-probability (an echoed first
    prompt token) is kept out by the caller's slicing; here it reads as NaN."""
    if not isinstance(logprobs, dict):
        return [], []
    if chat:
        entries = logprobs.get("content") or []
        return [str(e.get("token", "")) for e in entries], [_number(e.get("logprob")) for e in entries]
    tokens = logprobs.get("tokens") or []
    values = logprobs.get("token_logprobs") or []
    return [str(t) for t in tokens], [_number(v) for v in values]


def _number(value: object) -> float:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else float("nan")


def top_entries(logprobs: object, chat: bool, k: int) -> tuple[TopLogprobs, ...] | None:
    """Each position's ``k`` most likely tokens as (token id, log-probability), most likely
    first (chat: each entry's ``top_logprobs`` list; completions: one {token: log-probability}
    map per position); None unless every one names its token id (``return_tokens_as_token_ids``)."""
    if k <= 0 or not isinstance(logprobs, dict):
        return None
    if chat:
        raw = [[(a.get("token"), a.get("logprob")) for a in (e.get("top_logprobs") or []) if isinstance(a, dict)]
               for e in logprobs.get("content") or [] if isinstance(e, dict)]
    else:
        raw = [list(m.items()) if isinstance(m, dict) else [] for m in logprobs.get("top_logprobs") or []]
    out = []
    for position in raw:
        ids = token_ids([str(t) for t, _ in position]) if position else ()
        if ids is None:
            return None
        pairs = sorted(zip(ids, (_number(lp) for _, lp in position), strict=True), key=lambda a: -a[1])
        out.append(tuple(pairs[:k]))
    return tuple(out)


def token_ids(tokens: Sequence[str]) -> tuple[int, ...] | None:
    """Ids from vLLM's "token_id:123" token texts; None unless every token is one."""
    if not tokens or not all(t.startswith(TOKEN_ID) and t[len(TOKEN_ID):].isdigit() for t in tokens):
        return None
    return tuple(int(t[len(TOKEN_ID):]) for t in tokens)


def choice_text(choice: Json, chat: bool, *, delta: bool = False) -> str:
    if chat:
        message = choice.get("delta" if delta else "message") or {}
        return str(message.get("content") or "")
    return str(choice.get("text") or "")


def finish(reason: object) -> tuple[str | None, str | None]:
    """(metaloom finish reason, error text) for a server's finish reason (None: not finished)."""
    if reason is None:
        return None, None
    mapped = FINISH.get(str(reason))
    if mapped is not None:
        return mapped, None
    return "error", f"the server ended it with finish_reason {reason!r}"


def stop_reason(choice: Json) -> str | int | None:
    """vLLM's and metaloom's ``stop_reason``: the stop string, the stopping token id, or None."""
    value = choice.get("stop_reason")
    return value if isinstance(value, (str, int)) and not isinstance(value, bool) else None


def completion(choice: Json, *, chat: bool, encode: Encode | None, top: int = 0) -> Completion:
    """One choice of a (chat) completion as a `Completion`. Token ids: the server's (vLLM's
    token-id token texts), else the text encoded locally (``encode``: the text's tokens, which
    may differ from those generated, and no end-of-sequence), else none. ``top``: the
    number of alternatives per position asked for (`SamplingParams.top_logprobs`)."""
    text = choice_text(choice, chat)
    tokens, logprobs = logprob_entries(choice.get("logprobs"), chat)
    ids = token_ids(tokens)
    if ids is None:
        ids = tuple(encode(text)) if encode is not None and text else ()
    reason, error = finish(choice.get("finish_reason"))
    if reason is None:
        reason, error = "error", "the server gave no finish_reason"
    return Completion(text=text, token_ids=ids, logprobs=tuple(logprobs), finish_reason=reason,
                      stop_reason=stop_reason(choice) if reason == "stop" else None, error=error,
                      top_logprobs=top_entries(choice.get("logprobs"), chat, top))


def stream_chunk(choice: Json, *, chat: bool, first_index: int, encode: Encode | None, top: int = 0) -> StreamChunk | None:
    """One streamed choice as a `StreamChunk` of sample ``first_index + choice.index``; None
    for an empty piece (a chat stream's opening role-only delta)."""
    text = choice_text(choice, chat, delta=True)
    tokens, logprobs = logprob_entries(choice.get("logprobs"), chat)
    ids = token_ids(tokens)
    if ids is None:
        ids = tuple(encode(text)) if encode is not None and text else ()
    reason, error = finish(choice.get("finish_reason"))
    if not text and not ids and not logprobs and reason is None:
        return None
    index = choice.get("index", 0)
    return StreamChunk(text, ids, tuple(logprobs), reason, stop_reason(choice) if reason == "stop" else None,
                       first_index + (index if isinstance(index, int) else 0), error,
                       top_entries(choice.get("logprobs"), chat, top) or ())


def choices_of(data: Json, count: int | None = None) -> list[Json]:
    """The response's choices ordered by index; `ValueError` if they are not ``count`` objects."""
    raw = data.get("choices")
    if not isinstance(raw, list) or not all(isinstance(c, dict) for c in raw):
        raise ValueError(f"no list of choices in {json.dumps(data)[:200]}")
    if count is not None and len(raw) != count:
        raise ValueError(f"{len(raw)} choices where {count} were asked for")
    return sorted(raw, key=lambda c: c.get("index", 0) if isinstance(c.get("index", 0), int) else 0)


# --- usage ------------------------------------------------------------------------------------------
def usage_charge(usage: object, model_params: float | None) -> dict[str, Any]:
    """Ledger amounts for a response's ``usage``: prompt, cached and completion tokens; forward
    passes and FLOPs exactly where the server reports them (metaloom's ``usage.metaloom``), else
    forward passes marked unknown and FLOPs estimated as 2 · parameters · tokens computed when the
    parameter count is known (marked as an estimate), unknown when it is not. The KV memory the
    request held (``kv_bytes_peak``) is the server's where it reports one, else unknown: no
    estimate from tokens, since the server's sharing, paging and cache dtype are out of sight."""
    if not isinstance(usage, dict):
        return {}
    prompt = _count(usage.get("prompt_tokens"))
    output = _count(usage.get("completion_tokens"))
    details = usage.get("prompt_tokens_details")
    cached = _count(details.get("cached_tokens")) if isinstance(details, dict) else 0
    out: dict[str, Any] = {"input_tokens": prompt, "cached_tokens": min(cached, prompt), "output_tokens": output}
    exact = usage.get("metaloom")
    peak = exact.get("kv_bytes_peak") if isinstance(exact, dict) else None
    memory = frozenset() if isinstance(peak, int) and not isinstance(peak, bool) else frozenset({"kv_bytes_peak"})
    if isinstance(exact, dict):
        out["forward_passes"] = _count(exact.get("forward_passes"))
        flops = exact.get("flops")
        if isinstance(flops, (int, float)) and not isinstance(flops, bool) and flops >= 0:
            out["flops"] = float(flops)
        if not memory:
            out["kv_bytes_peak"] = _count(peak)
    elif model_params is not None:
        out["flops"] = 2.0 * model_params * (prompt - min(cached, prompt) + output)
        out["estimated"], out["unknown"] = frozenset({"flops"}), frozenset({"forward_passes"})
    else:
        out["unknown"] = frozenset({"forward_passes", "flops"})
    if memory:
        out["unknown"] = out.get("unknown", frozenset()) | memory
    return out


def _count(value: object) -> int:
    return int(value) if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0

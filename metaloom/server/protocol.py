"""The OpenAI request bodies (`metaloom.server.bodies`) translated into metaloom `Request`s.

Every field OpenAI defines is either honoured or refused with a 400 that names it (``audio``,
``suffix``, the deprecated ``functions``…): never silently dropped. Function calling (``tools``,
``tool_choice``, ``parallel_tool_calls``, ``tool`` messages) is `metaloom.server.tools`.
metaloom's own sampling parameters sit beside OpenAI's under the names vLLM uses (``top_k``, ``min_p``, ``repetition_penalty``,
``include_stop_str_in_output``, ``guided_json``, ``guided_regex``, ``guided_choice``,
``guided_grammar``), and the rest under their `SamplingParams` names; decoders under
``decoder`` with `DecoderOptions`' names; a strategy under ``metaloom``.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel

from metaloom.constrain.spec import ConstraintSpec
from metaloom.decode.specs import DECODERS, DecoderOptions, build_decoder
from metaloom.errors import InvalidParameter
from metaloom.generator.types import Request, TokenIds
from metaloom.sampling.params import SamplingParams
from metaloom.server import tools
from metaloom.server.bodies import REFUSED, StrategyOptions, TokenizeBody


def _refuse_unsupported(body: BaseModel) -> None:
    for name in REFUSED:
        value = getattr(body, name, None)
        if value not in (None, False, [], {}):
            if name == "best_of" and value == (getattr(body, "n", None) or 1):  # best_of == n is plain sampling
                continue
            raise InvalidParameter(name, value, "not set: metaloom's server does not support it")


MAX_TOP_LOGPROBS = 20  # OpenAI's limit (and vLLM's default max_logprobs)


def _top_count(name: str, value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_TOP_LOGPROBS:
        raise InvalidParameter(name, value, f"an integer in [0, {MAX_TOP_LOGPROBS}]")
    return value


def sampling_params(body: BaseModel, *, chat: bool) -> SamplingParams:
    """The body's sampling parameters (validated by `SamplingParams`, which names a bad field)."""
    data = body.model_dump(exclude_none=True, by_alias=False)
    if chat:
        if data.get("max_completion_tokens") is not None:
            if data.get("max_tokens", data["max_completion_tokens"]) != data["max_completion_tokens"]:
                raise InvalidParameter("max_completion_tokens", data["max_completion_tokens"],
                                       f"not set beside a different max_tokens ({data['max_tokens']}): one of them")
            data["max_tokens"] = data["max_completion_tokens"]
        if data.get("top_logprobs") is not None:
            _top_count("top_logprobs", data["top_logprobs"])
            if not data.get("logprobs"):
                raise InvalidParameter("top_logprobs", data["top_logprobs"], "set only with logprobs: true")
    else:
        if data.get("logprobs") is not None:  # the completions API's logprobs: how many alternatives per position
            data["top_logprobs"] = _top_count("logprobs", data["logprobs"])
        if data.get("max_tokens") == 0 and data.get("echo"):  # OpenAI's way to score a prompt: echo it, generate nothing
            data.pop("max_tokens")
    data.pop("logprobs", None)
    return SamplingParams.from_openai(data)


def scores_only(body: BaseModel) -> bool:
    """``echo`` with ``max_tokens: 0``: the prompt (and its log-probabilities) back, nothing generated."""
    b: Any = body
    return bool(b.echo) and b.max_tokens == 0


def prompt_logprobs(body: BaseModel) -> int | None:
    """How many alternatives to report at each prompt position (None: no prompt log-probabilities):
    vLLM's ``prompt_logprobs``, or OpenAI's ``echo`` with ``logprobs``."""
    b: Any = body
    if b.prompt_logprobs is not None:
        return _top_count("prompt_logprobs", b.prompt_logprobs)
    if b.echo and b.logprobs is not None:
        return _top_count("logprobs", b.logprobs)
    return None


def constraint(body: BaseModel) -> ConstraintSpec | None:
    """At most one of ``response_format`` (json_object / json_schema) and vLLM's ``guided_*``."""
    named = named_constraint(body)
    return named[1] if named is not None else None


def named_constraint(body: BaseModel) -> tuple[str, ConstraintSpec] | None:
    """`constraint`, with the field that set it (an error compiling it names that field)."""
    found: list[tuple[str, ConstraintSpec]] = []
    fmt = getattr(body, "response_format", None)
    if fmt is not None and fmt.type != "text":
        if fmt.type == "json_object":
            found.append(("response_format", ConstraintSpec.json_schema({"type": "object"})))
        else:
            if fmt.json_schema is None or fmt.json_schema.schema_ is None:
                raise InvalidParameter("response_format.json_schema.schema", None, "a JSON Schema")
            found.append(("response_format", ConstraintSpec.json_schema(fmt.json_schema.schema_)))
    b: Any = body
    if b.guided_json is not None:
        found.append(("guided_json", ConstraintSpec.json_schema(b.guided_json)))
    if b.guided_regex is not None:
        found.append(("guided_regex", ConstraintSpec.regex(b.guided_regex)))
    if b.guided_choice is not None:
        found.append(("guided_choice", ConstraintSpec.choices(b.guided_choice)))
    if b.guided_grammar is not None:
        found.append(("guided_grammar", ConstraintSpec.lark(b.guided_grammar)))
    so = b.structured_outputs
    if so is not None:
        given = [(name, value) for name, value in (("json", so.json_), ("regex", so.regex), ("choice", so.choice),
                                                   ("grammar", so.grammar)) if value is not None]
        if len(given) != 1:
            raise InvalidParameter("structured_outputs", so.model_dump(by_alias=True, exclude_none=True),
                                   "exactly one of json, regex, choice, grammar")
        name, value = given[0]
        build = {"json": ConstraintSpec.json_schema, "regex": ConstraintSpec.regex, "choice": ConstraintSpec.choices,
                 "grammar": ConstraintSpec.lark}[name]
        found.append((f"structured_outputs.{name}", build(value)))
    if len(found) > 1:
        raise InvalidParameter(found[1][0], "set", f"one constraint per request (already {found[0][0]})")
    return found[0] if found else None


def messages(raw: list[dict[str, Any]]) -> tuple[dict[str, str], ...]:
    """Chat messages as the engine takes them: role and text. Text parts are joined; images,
    audio and tool messages are refused naming where."""
    if not raw:
        raise InvalidParameter("messages", raw, "at least one message")
    out = []
    for i, m in enumerate(raw):
        role, content = m.get("role"), m.get("content")
        if role not in ("system", "user", "assistant", "developer"):
            raise InvalidParameter(f"messages[{i}].role", role, "one of system, developer, user, assistant")
        extra = sorted(set(m) - {"role", "content", "name"})
        if extra:
            raise InvalidParameter(f"messages[{i}].{extra[0]}", m[extra[0]], "not set: only role, content and name")
        text = tools.message_text(content, f"messages[{i}].content")
        out.append({"role": "system" if role == "developer" else role, "content": text})
    return tuple(out)


def decoder(body: BaseModel, params: SamplingParams) -> tuple[SamplingParams, Any]:
    b: Any = body
    if b.decoder is None:
        given = [f.name for f in dataclasses.fields(DecoderOptions) if getattr(b, f.name) is not None]
        if given:
            raise InvalidParameter(given[0], getattr(b, given[0]), f"set with a decoder (decoder: one of {sorted(DECODERS)})")
        return params, None
    options = DecoderOptions(**{f.name: getattr(b, f.name) for f in dataclasses.fields(DecoderOptions)
                                if getattr(b, f.name) is not None})
    return build_decoder(b.decoder, params, options)


def valid_text(value: Any, name: str) -> None:
    """Every string in ``value`` (a body, or one field of it) is Unicode text: a lone UTF-16
    surrogate (``"\\ud800"``, which JSON can carry and no tokenizer encodes) is an
    `InvalidParameter` naming where it is."""
    if isinstance(value, str):
        if any("\ud800" <= c <= "\udfff" for c in value):
            raise InvalidParameter(name, value.encode("utf-8", "backslashreplace").decode()[:80],
                                   "valid Unicode text (no unpaired UTF-16 surrogate)")
    elif isinstance(value, Mapping):
        for k, v in value.items():
            valid_text(v, f"{name}.{k}" if name else str(k))
    elif isinstance(value, list | tuple):
        for i, v in enumerate(value):
            valid_text(v, f"{name}[{i}]")


def calls_tools(body: BaseModel) -> bool:
    """Whether a chat body uses function calling: tools or a tool choice given, or a history
    holding calls or their results."""
    b: Any = body
    return (b.tools is not None or b.tool_choice is not None or b.parallel_tool_calls is not None
            or any(isinstance(m, dict) and (m.get("role") == "tool" or m.get("tool_calls")) for m in b.messages))


def chat_request(body: BaseModel, tokenizer: Any = None) -> tuple[Request, bool]:
    """The chat body's request, and whether its replies are read for function calls. With
    function calling (`calls_tools`) the prompt is rendered here with ``tokenizer`` (the tools
    in its template or the documented format, `metaloom.server.tools`) and sent as token ids,
    and the reply's grammar is the tool choice's."""
    valid_text(body.model_dump(exclude_none=True, by_alias=True), "")
    _refuse_unsupported(body)
    params = sampling_params(body, chat=True)
    params, spec = decoder(body, params)
    b: Any = body
    own = constraint(body)
    if not calls_tools(body):
        return Request(messages(b.messages), params, constraint=own, token_healing=b.token_healing, decoder=spec), False
    given = tools.functions(b.tools) if b.tools is not None else ()
    choice = tools.tool_choice(b.tool_choice, given, b.parallel_tool_calls)
    history = tools.history(b.messages)
    if b.token_healing:
        raise InvalidParameter("token_healing", True, "false with function calling (the reply's start is the grammar's)")
    calling = bool(given) and choice.mode != "none"
    if calling and own is not None:
        raise InvalidParameter("response_format" if b.response_format is not None else "guided_json", "set",
                               f"not set with tool_choice {choice.mode!r}: the reply's grammar is the tools'")
    grammar = tools.grammar(given, choice) if given and own is None else own
    if tokenizer is None:
        raise InvalidParameter("tools", "set", "a server whose engine has a tokenizer")
    ids = tokenizer.encode(tools.render(tokenizer, history, given), add_special_tokens=False)
    return Request(TokenIds(tuple(ids)), params, constraint=grammar, decoder=spec), calling


def completion_requests(body: BaseModel) -> list[Request]:
    """One request per prompt (a list of prompts is a batch; token-id lists are exact prompts)."""
    valid_text(body.model_dump(exclude_none=True, by_alias=True), "")
    _refuse_unsupported(body)
    params = sampling_params(body, chat=False)
    params, spec = decoder(body, params)
    b: Any = body
    prompt = b.prompt
    prompts: list[Any]
    if isinstance(prompt, str):
        prompts = [prompt]
    elif prompt and all(isinstance(p, int) for p in prompt):
        prompts = [TokenIds(tuple(prompt))]
    elif prompt and all(isinstance(p, list) for p in prompt):
        prompts = [TokenIds(tuple(p)) for p in prompt]
    else:
        prompts = list(prompt)
    if not prompts:
        raise InvalidParameter("prompt", prompt, "a non-empty prompt or list of prompts")
    return [Request(p, params, constraint=constraint(body), token_healing=b.token_healing, decoder=spec) for p in prompts]


def strategy_params(options: StrategyOptions) -> tuple[dict[str, str], dict[str, dict[str, str]]]:
    """The ``metaloom.params`` object as the CLI's text parameters: ``{"n": 8, "scorer": "judge",
    "scorer.limits": ...}``; a nested object configures the component chosen by that field."""
    params: dict[str, str] = {}
    groups: dict[str, dict[str, str]] = {}
    for key, value in options.params.items():
        group, dot, sub = key.partition(".")
        if isinstance(value, Mapping) and not dot:
            groups.setdefault(key, {}).update({k: _text(v) for k, v in value.items()})
        elif dot:
            groups.setdefault(group, {})[sub] = _text(value)
        else:
            params[key] = _text(value)
    return params, groups


def _text(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, bool):
        return "true" if value else "false"
    return json.dumps(value)



def tokenize_text(body: TokenizeBody, tokenizer: Any) -> tuple[str, bool]:
    """The text `/tokenize` encodes, and whether the tokenizer adds special tokens to it: a text
    prompt as given; messages through the chat template, with function calling's tools and
    history (`metaloom.server.tools`) exactly as a chat request renders them."""
    if body.messages is None:
        return body.prompt or "", body.add_special_tokens
    calling = body.tools is not None or any(isinstance(m, dict) and (m.get("role") == "tool" or m.get("tool_calls"))
                                            for m in body.messages)
    if calling:
        given = tools.functions(body.tools) if body.tools is not None else ()
        return tools.render(tokenizer, tools.history(body.messages), given), False
    return tokenizer.apply_chat_template(list(messages(body.messages)), add_generation_prompt=body.add_generation_prompt), False



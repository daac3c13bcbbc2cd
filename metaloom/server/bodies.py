"""The OpenAI request bodies as pydantic models (so the app publishes a real OpenAPI schema);
`metaloom.server.protocol` translates them into metaloom `Request`s.

A field OpenAI defines that metaloom does not serve is still a field here, listed in `REFUSED`
(refused with a 400 that names it, never silently dropped). metaloom's own sampling parameters
sit beside OpenAI's under the names vLLM uses, and the rest under their `SamplingParams` names
(every dataclass field, added by `create_model`); decoders under ``decoder`` with
`DecoderOptions`' names; a strategy under ``metaloom``; vLLM's ``/tokenize`` and ``/detokenize``.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
import types
import typing
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, create_model

from metaloom.decode.specs import DecoderOptions
from metaloom.sampling.params import SamplingParams

# OpenAI fields metaloom does not serve: a request that sets one (to anything but null/false/empty)
# is refused naming it
REFUSED = ("functions", "function_call", "audio", "modalities",
           "prediction", "reasoning_effort", "service_tier", "store", "metadata", "web_search_options", "suffix",
           "best_of", "verbosity", "prompt_cache_key", "safety_identifier")


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False
    # vLLM's: in every chunk, that choice's tokens so far (a client that stops early knows its cost)
    continuous_usage_stats: bool = False


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(BaseModel):
    """vLLM's current constraint object (it replaced the ``guided_*`` fields): one of these."""

    model_config = ConfigDict(extra="forbid")
    json_: dict[str, Any] | str | bool | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


class StrategyOptions(BaseModel):
    """``{"strategy": "majority_vote", "params": {"n": 8}, "budget": {"output_tokens": 2000}}``;
    ``trace``: include the strategy's trace in the response."""

    model_config = ConfigDict(extra="forbid")
    strategy: str
    params: dict[str, Any] = Field(default_factory=dict)
    budget: dict[str, float] = Field(default_factory=dict)
    trace: bool = False


# every SamplingParams field OpenAI does not define, under its own name (vLLM's where vLLM has one)
_OPENAI_SAMPLING = {"temperature", "top_p", "n", "seed", "stop", "presence_penalty", "frequency_penalty", "logit_bias",
                    "max_tokens", "top_logprobs"}
def _json_hint(hint: Any) -> Any:
    """A dataclass field's type as a JSON body carries it: tuples arrive as lists (the bodies are
    validated strictly, so "4" is no integer and "yes" no boolean, and a strict tuple takes no list)."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) is tuple and len(args) == 2 and args[1] is Ellipsis:
        return list[args[0]]  # type: ignore[valid-type]
    if args and typing.get_origin(hint) in (typing.Union, types.UnionType):
        return functools.reduce(operator.or_, [_json_hint(a) for a in args])
    return hint


_HINTS = typing.get_type_hints(SamplingParams)
_EXTRA_SAMPLING: dict[str, Any] = {f.name: (_json_hint(_HINTS[f.name]) | None, None)
                                   for f in dataclasses.fields(SamplingParams) if f.name not in _OPENAI_SAMPLING}
_DECODER_HINTS = typing.get_type_hints(DecoderOptions)
_DECODER_FIELDS: dict[str, Any] = {f.name: (_json_hint(_DECODER_HINTS[f.name]) | None, None)
                                   for f in dataclasses.fields(DecoderOptions)}
_REFUSED_FIELDS: dict[str, Any] = {name: (Any, None) for name in REFUSED}


class _Common(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True, strict=True)
    model: str
    n: int | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # an end-user id for the caller's own records; changes nothing here
    # constraints, by vLLM's names
    guided_json: dict[str, Any] | str | bool | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputs | None = None
    decoder: str | None = None
    token_healing: bool = False
    return_tokens_as_token_ids: bool = False  # vLLM's: logprobs name tokens "token_id:123" (exact, whatever the bytes)
    metaloom: StrategyOptions | None = None


class ChatFields(_Common):
    """What the chat route reads itself; the sampling, decoder and refused fields are added by
    `create_model` (`ChatBody`), which a type checker cannot see: the routes read a body as this."""

    messages: list[dict[str, Any]]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    response_format: ResponseFormat | None = None
    # function calling (`metaloom.server.tools` checks them: its errors name the field)
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: Any = None


class CompletionFields(_Common):
    """What the completions route reads itself (see `ChatFields`)."""

    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    prompt_logprobs: int | None = None


ChatBody = create_model("ChatBody", __base__=ChatFields, **_EXTRA_SAMPLING, **_DECODER_FIELDS, **_REFUSED_FIELDS)
CompletionBody = create_model("CompletionBody", __base__=CompletionFields, **_EXTRA_SAMPLING, **_DECODER_FIELDS,
                              **_REFUSED_FIELDS)


class TokenizeBody(BaseModel):
    """vLLM's ``POST /tokenize``: a text prompt, or chat messages through the chat template."""

    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool = True  # a text prompt: as the tokenizer adds them (the chat template adds its own)
    add_generation_prompt: bool = True
    return_token_strs: bool = False
    tools: list[Any] | None = None  # function calling: the prompt as a chat request with these tools reads it


class DetokenizeBody(BaseModel):
    """vLLM's ``POST /detokenize``."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    tokens: list[int]

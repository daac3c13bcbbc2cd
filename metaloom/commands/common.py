"""Arguments shared by subcommands."""

from __future__ import annotations

import argparse
import os
from dataclasses import fields
from typing import Any, NotRequired, TypedDict

from metaloom.errors import InvalidParameter
from metaloom.sampling import SamplingParams
from metaloom.sampling.params import SAMPLER_FLAGS
from metaloom.wiring import engines

_DEFAULTS = {f.name: f.default for f in fields(SamplingParams)}

# sampler flags: (SamplingParams field, type, help), read from the fields' declarations
# (`metaloom.sampling.knobs`); the flag is the field with dashes
_SAMPLER_FLAGS = SAMPLER_FLAGS


# metaloom.models.engine.options' KV_DTYPES and SHARED_PREFIX_MODES and
# metaloom.models.engine.kv_policy's POLICIES, written out: importing those modules imports torch
# (through metaloom.models), which the CLI must not need to parse flags or to talk to a remote
# server; tests/test_kv_int8.py and tests/test_kv_policy_flags.py check they agree
KV_DTYPES = ("auto", "float32", "bfloat16", "int8")
SHARED_PREFIX_MODES = ("auto", "on", "off")
KV_POLICIES = ("full", "streaming", "h2o", "snapkv")

_SCALAR_DESTS = (*(name for name, _, _ in _SAMPLER_FLAGS), "max_tokens", "n", "seed")
# every dest `add_sampling_args` defines
SAMPLER_DESTS = (*_SCALAR_DESTS, "stop", "logit_bias", "dry_sequence_breakers", "no_dry_sequence_breakers")


def add_model_args(p: argparse.ArgumentParser, *, remote: bool = False, activations: str = "float") -> None:
    """The model flags; ``remote``: also ``--backend openai`` (any OpenAI-compatible server);
    ``activations``: ``--activations``' default (`metaloom serve`: auto)."""
    p.add_argument("--model", default="default",
                   help="'default' (SmolLM2-135M-Instruct), a .gguf file, or a transformers folder"
                        + ("; with --backend openai, the model id the server lists" if remote else ""))
    p.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16")
    p.add_argument("--device", default="auto", help="auto (CUDA when present) | cpu | cuda | cuda:N")
    p.add_argument("--backend", default="auto",
                   help="auto = the native engine where it runs the architecture (Llama 3.x, SmolLM2, Qwen2/3, "
                        "Mistral, Gemma 2/3, Phi-3/3.5/4-mini), else transformers (any causal LM or GGUF it reads); "
                        "--json's usage says which ran | native | transformers" + (" | openai" if remote else ""))
    p.add_argument("--chat-template-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="a variable for the model's chat template, e.g. enable_thinking=false (Qwen3); VALUE is "
                        "JSON where it parses (true, 3, \"text\"), else text (repeatable)")
    p.add_argument("--weights", default="auto", choices=("auto", "native", "dense"),
                   help="a GGUF's weights: native = its quantised blocks as they are (quantised CPU kernels), "
                        "dense = dequantised to --dtype, auto = whichever decodes faster here (measured once)")
    p.add_argument("--activations", default=activations, choices=("float", "q8", "auto"),
                   help="the native engine's matmul inputs: float (--dtype), or q8 = quantised to int8 per 32 and "
                        "multiplied with integer dot products (faster for many rows; needs native quantised weights), "
                        f"or auto = q8 where it can run, else float (default: {activations})")
    p.add_argument("--kv-dtype", default="auto", choices=KV_DTYPES,
                   help="the native engine's KV cache: auto = --dtype; int8 = int8 keys and values with a float32 "
                        "scale per token and head (3.8x less memory than float32 at head_dim 64)")
    p.add_argument("--shared-prefix-attention", default="auto", choices=SHARED_PREFIX_MODES,
                   help="the native engine's attention over keys several rows share (forks of one prompt): "
                        "on, off, or auto = where the step shares enough to gain")
    p.add_argument("--kv-policy", default="full", choices=KV_POLICIES,
                   help="which positions a row keeps once it holds --kv-budget tokens: full keeps all; "
                        "streaming = StreamingLLM attention sinks + recent window; h2o = heavy hitters by "
                        "accumulated attention + recent; snapkv = the prompt compressed by its last 32 "
                        "queries' attention")
    p.add_argument("--kv-budget", type=int, default=None, help="KV positions a row may hold under --kv-policy")
    if remote:
        g = p.add_argument_group("a remote server (--backend openai: vLLM, SGLang, llama.cpp, metaloom serve, ...)")
        g.add_argument("--base-url", default=None, help="the server, e.g. http://127.0.0.1:8000 (or .../v1)")
        g.add_argument("--api-key", default=None, help="its key (default: $OPENAI_API_KEY, else none)")
        g.add_argument("--model-params", type=float, default=None,
                       help="the model's parameter count, for FLOPs estimates (e.g. 1.5e9)")
        g.add_argument("--tokenizer", default=None,
                       help="a local tokenizer folder, for what the server has no route for (token ids, chat template)")
        g.add_argument("--max-concurrency", type=int, default=16, help="requests in flight at once")
        g.add_argument("--timeout", type=float, default=600.0, help="seconds a request may wait for the server")
        g.add_argument("--max-retries", type=int, default=3,
                       help="retries of a request on 429, 5xx and dropped connections (never on other 4xx)")


# flags a remote server decides for itself, with their defaults
_LOCAL_ONLY = {"dtype": "float32", "device": "auto", "weights": "auto", "activations": "float", "kv_dtype": "auto",
               "shared_prefix_attention": "auto", "kv_policy": "full", "kv_budget": None}


def refuse_local_only(args: argparse.Namespace) -> None:
    """With ``--backend openai``: an `InvalidParameter` naming the first flag a remote server
    decides for itself that was set away from its default (never silently dropped)."""
    for name, default in _LOCAL_ONLY.items():
        if getattr(args, name, default) != default:
            raise InvalidParameter(name.replace("_", "-"), getattr(args, name),
                                   "left unset with --backend openai (the server decides it)")


class EngineFlags(TypedDict):
    """The native engine's options, as `metaloom.models.load.load` takes them; the KV policy
    and budget only when set away from full (``load``'s defaults), so a load without them
    passes what it passed before they existed."""

    kv_dtype: str
    shared_prefix_attention: str
    kv_policy: NotRequired[str]
    kv_budget: NotRequired[int | None]
    chat_template_args: NotRequired[dict[str, Any]]
    activations: NotRequired[str]


def engine_options(args: argparse.Namespace) -> EngineFlags:
    """``--kv-dtype``, ``--shared-prefix-attention``, ``--kv-policy``, ``--kv-budget`` and
    ``--activations`` (`add_model_args`), for ``load(**...)``. A policy and budget that do not go together are an
    `InvalidParameter` naming ``kv_policy`` or ``kv_budget`` here, before any model is read."""
    flags = EngineFlags(kv_dtype=args.kv_dtype, shared_prefix_attention=args.shared_prefix_attention)
    if (args.kv_policy, args.kv_budget) != ("full", None):
        from metaloom.models.engine.kv_policy import check_policy  # imports torch: only when set

        check_policy(args.kv_policy, args.kv_budget)
        flags["kv_policy"], flags["kv_budget"] = args.kv_policy, args.kv_budget
    if getattr(args, "chat_template_arg", None):
        flags["chat_template_args"] = chat_template_args(args.chat_template_arg)
    if getattr(args, "activations", "float") != "float":
        flags["activations"] = args.activations
    return flags


def chat_template_args(items: list[str]) -> dict[str, Any]:
    """``--chat-template-arg KEY=VALUE`` items as a dict; VALUE as JSON where it parses."""
    import json

    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.isidentifier():
            raise InvalidParameter("chat-template-arg", item, "KEY=VALUE with KEY a template variable name")
        try:
            out[key] = json.loads(value)
        except ValueError:
            out[key] = value
    return out


def remote_generator(args: argparse.Namespace, local_only: dict[str, object] | None = None) -> Any:
    """The `RemoteGenerator` that ``--backend openai`` asks for, or None for a local backend.
    ``local_only``: other flags (name -> value as given) that need the local engine; one that is
    set is an error naming it, never silently dropped."""
    if args.backend != "openai":
        for name in ("base_url", "model_params", "tokenizer"):
            if getattr(args, name, None) is not None:
                raise InvalidParameter(name.replace("_", "-"), getattr(args, name), "set only with --backend openai")
        return None
    refuse_local_only(args)
    for name, value in (local_only or {}).items():
        if value not in (None, False):
            raise InvalidParameter(name, value, "unset with --backend openai (it needs the local engine)")
    if not args.base_url:  # before the flags a remote server decides: the missing URL is the first mistake
        raise InvalidParameter("base-url", None, "the server's URL with --backend openai (e.g. http://127.0.0.1:8000)")
    return engines.remote_generator(args.base_url, args.model, api_key=args.api_key or os.environ.get("OPENAI_API_KEY"),
                                    tokenizer=args.tokenizer, model_params=args.model_params,
                                    max_concurrency=args.max_concurrency, timeout=args.timeout,
                                    max_retries=args.max_retries)


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling (applied in the order of metaloom.sampling.pipeline)")
    for name, kind, text in _SAMPLER_FLAGS:
        g.add_argument("--" + name.replace("_", "-"), dest=name, type=kind, default=_DEFAULTS[name], help=text)
    g.add_argument("--dry-sequence-breaker", dest="dry_sequence_breakers", action="append", default=None,
                   help="DRY: string that stops a repeat (repeatable; default: newline : \" *)")
    g.add_argument("--no-dry-sequence-breakers", action="store_true", help="DRY: no sequence breakers at all")
    g.add_argument("--logit-bias", action="append", default=[], metavar="TOKEN=BIAS",
                   help="add BIAS to the logit of token id TOKEN (repeatable)")
    p.add_argument("--max-tokens", type=int, default=_DEFAULTS["max_tokens"])
    p.add_argument("--n", type=int, default=_DEFAULTS["n"], help="number of samples (prompt prefilled once)")
    p.add_argument("--seed", type=int, default=_DEFAULTS["seed"])
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def _logit_bias(items: list[str]) -> dict[int, float]:
    bias: dict[int, float] = {}
    for item in items:
        token, sep, value = item.partition("=")
        try:
            if not sep:
                raise ValueError(item)
            bias[int(token)] = float(value)
        except ValueError as exc:
            raise InvalidParameter("logit_bias", item, "TOKEN=BIAS with an integer token id and a number") from exc
    return bias


def sampling_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """`SamplingParams` keyword arguments from the sampler flags present in ``args`` (a command
    that sets ``argparse.SUPPRESS`` defaults for `SAMPLER_DESTS` gets only the flags given)."""
    kwargs = {name: getattr(args, name) for name in _SCALAR_DESTS if hasattr(args, name)}
    if hasattr(args, "stop"):
        kwargs["stop"] = tuple(args.stop)
    if getattr(args, "logit_bias", None):
        kwargs["logit_bias"] = _logit_bias(args.logit_bias)
    breakers = getattr(args, "dry_sequence_breakers", None)
    if breakers is not None:
        kwargs["dry_sequence_breakers"] = tuple(breakers)
    if getattr(args, "no_dry_sequence_breakers", False):
        if breakers is not None:
            raise InvalidParameter("dry_sequence_breakers", tuple(breakers),
                                   "either --dry-sequence-breaker or --no-dry-sequence-breakers, not both")
        kwargs["dry_sequence_breakers"] = ()
    return kwargs


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(**sampling_kwargs(args))


def kernel_usage(loaded: object) -> dict[str, str]:
    """``{"backend": which engine ran the local model (native or transformers), "activations":
    float or q8, "isa": path}``:
    the instruction-set path metaloom's CPU kernels ran for it on the CPU
    (`metaloom.models.kernels.isa`; "none: why" where they could not be built); {} for a remote one."""
    model = getattr(loaded, "model", None)
    if model is None:
        return {}
    backend = {"backend": str(getattr(loaded, "backend", "native")),
               "activations": str(getattr(loaded, "activations", "float"))}
    if str(getattr(model, "device", "cpu")) != "cpu":
        return backend
    from metaloom.models.kernels.quant_library import kernels

    available = kernels()
    return backend | {"isa": available.kernels.isa if available.kernels is not None else f"none: {available.reason}"}

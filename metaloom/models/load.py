"""Load a model (`load`): the native engine or transformers, on the device asked for, with the
weights, kernels and KV cache options asked for. Finding the model and converting a GGUF into a
transformers folder once is `metaloom.models.find`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from metaloom.errors import InvalidParameter, NotAModel, UnsupportedModel
from metaloom.models.engine.config import NATIVE_MODEL_TYPES, LlamaConfig
from metaloom.models.engine.options import EngineOptions
from metaloom.models.engine.tokenizer import HFTokenizer
from metaloom.models.find import fingerprint, gguf_source, resolve
from metaloom.models.protocols import LanguageModel, Tokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
BACKENDS = ("auto", "native", "transformers")
WEIGHTS = ("auto", "native", "dense")  # see metaloom.models.engine.native
ACTIVATIONS = ("float", "q8")  # metaloom.models.kernels.quant.ACTIVATIONS


@dataclass(frozen=True)
class LoadedModel:
    model: LanguageModel
    tokenizer: Tokenizer
    name: str
    folder: str  # a transformers-loadable folder holding these weights (dequantised)
    dtype: torch.dtype
    weights: str = "dense"  # "native": a GGUF's quantised blocks as they are (metaloom.models.engine.native)
    backend: str = "native"  # which engine runs it: "native" or "transformers"
    activations: str = "float"  # "q8": int8 activations, integer products (metaloom.models.engine.native)


def load_state_dict(folder: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
    if not files:
        raise NotAModel(f"{folder} has no .safetensors weights")
    sd: dict[str, torch.Tensor] = {}
    for name in files:
        try:
            sd.update(load_file(os.path.join(folder, name)))
        except Exception as exc:  # safetensors raises its own error types on corrupt files
            raise NotAModel(f"{os.path.join(folder, name)} is not a readable safetensors file: {exc}") from exc
    return sd


def pick_device(device: str | None) -> torch.device:
    """The torch device for ``--device``: auto is CUDA when present, else the CPU. A CUDA device
    this machine does not have is an `InvalidParameter` naming what it has, before any weight
    moves (not PyTorch's assertion from deep inside the load)."""
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError as exc:
        raise InvalidParameter("device", device, "cpu, cuda, cuda:N or auto") from exc
    if dev.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            why = "this PyTorch was built without CUDA" if not torch.backends.cuda.is_built() else "no CUDA GPU is visible"
            raise InvalidParameter("device", device, f"cpu or auto here: {why}")
        if dev.index is not None and dev.index >= count:
            raise InvalidParameter("device", device, f"cuda:0 .. cuda:{count - 1} (this machine has {count} GPUs)")
    elif dev.type != "cpu":
        raise InvalidParameter("device", device, "cpu, cuda, cuda:N or auto")
    return dev


def load(spec: str | None = "default", *, dtype: str = "float32", device: str | None = None,
         backend: str = "auto", pack: bool | None = None, fused: bool | None = None,
         weights: str | None = None, kv_dtype: str = "auto", shared_prefix_attention: str = "auto",
         kv_policy: str = "full", kv_budget: int | None = None,
         chat_template_args: Mapping[str, Any] | None = None, activations: str = "float") -> LoadedModel:
    """Load a model (see the module docstring). For the native model:

    - ``weights``: ``native`` keeps a GGUF's quantised blocks and multiplies by them in the
      quantised kernels (`metaloom.models.engine.native`); ``dense`` dequantises to ``dtype``; None or
      ``auto``: for a GGUF on the CPU, whichever decodes faster here (measured once, recorded),
      else dense;
    - ``pack``: also keep the linear weights in the CPU GEMM libraries' packed layouts
      (`metaloom.models.kernels.packed`); None packs on the CPU when the extra copies take under a
      quarter of the machine's memory, and for bfloat16 on a CPU where oneDNN has no bfloat16
      kernels multiplies by metaloom's own instead (`Bf16Linear`, the same storage);
    - ``fused``: take one-token decode steps through the fused CPU kernels
      (`metaloom.models.kernels.fused`, float32 and bfloat16); None uses them where they build and apply;
    - ``kv_dtype`` (auto, float32, bfloat16, int8) and ``shared_prefix_attention`` (auto, on,
      off): how the KV cache is held and read (`metaloom.models.engine.options.EngineOptions`);
    - ``kv_policy`` (full, streaming, h2o, snapkv) and ``kv_budget`` (tokens; set exactly when
      the policy is not full): which positions a row keeps once it holds ``kv_budget``
      (`metaloom.models.engine.kv_policy`);
    - ``chat_template_args``: extra variables for the model's chat template (Qwen3's
      ``enable_thinking``);
    - ``activations``: ``float`` (``dtype``), or ``q8``: the layers' matmuls quantise their inputs
      to int8 per 32 and multiply with integer dot products (faster for many rows; the arithmetic
      changes, docs/engine.md). q8 needs native quantised weights (``weights`` auto then means
      native): with the transformers backend, dense weights or a GPU it is an `InvalidParameter`.
      ``auto`` (`metaloom serve`'s default): q8 where it can run (a GGUF on the native engine on
      the CPU, float32 or bfloat16, ``weights`` not dense, every layer weight quantised blocks),
      else float; the result's ``activations`` says which.

    ``backend``: ``auto`` runs the native engine when it runs the model's architecture
    (`metaloom.models.engine.config.LlamaConfig.from_hf` accepts its config), else transformers;
    the result's ``backend`` says which ran.

    True for either of pack and fused where it cannot be done is an `InvalidParameter` naming
    why; so is a kv_dtype or shared_prefix_attention other than auto, a kv_policy other than
    full or a kv_budget for the transformers backend, which keeps its own cache."""
    _check_choices(dtype, backend, weights, activations)
    options = EngineOptions(kv_dtype=kv_dtype, shared_prefix_attention=shared_prefix_attention,
                            kv_policy=kv_policy, kv_budget=kv_budget)  # validates them
    name, folder = resolve(spec)
    try:
        with open(os.path.join(folder, "config.json")) as f:
            hf_cfg = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise NotAModel(f"{folder}/config.json is not readable JSON: {exc}") from exc
    dev = pick_device(device)
    why_native = native_reason(hf_cfg)
    use_native = backend == "native" or (backend == "auto" and why_native is None)
    if not use_native:  # refuse before reading any weights
        _refuse_engine_options(options, hf_cfg.get("model_type"))
        _check_transformers_rope(hf_cfg, why_native)
    gguf = gguf_source(spec)
    why_dense = _why_not_native(gguf, use_native, dtype, dev)
    if weights == "native" and why_dense is not None:
        raise InvalidParameter("weights", weights, f"dense here: {why_dense}")
    may_fall_back = activations == "auto"  # to float where a layer weight is not one q8 multiplies
    if activations == "auto":
        activations = "q8" if use_native and why_dense is None and weights != "dense" else "float"
    q8 = activations == "q8"
    if q8 and (why_dense is not None or weights == "dense"):
        raise InvalidParameter("activations", activations, "float here: q8 multiplies native quantised weights, and "
                                                           f"{why_dense or 'weights=dense dequantises them'}")
    if use_native:
        config = LlamaConfig.from_hf(hf_cfg)
        model, mode, activations = _load_native(config, folder, gguf, why_dense, dtype=dtype, device=dev, pack=pack,
                                                fused=fused, weights=weights, activations=activations, options=options,
                                                may_fall_back=may_fall_back)
        eos = config.eos_token_id
    else:
        from metaloom.models.engine.hf_adapter import HFModel

        model = HFModel.from_folder(folder, dtype=DTYPES[dtype], device=dev)
        mode = "dense"
        eos = _ids(hf_cfg.get("eos_token_id"))
    tokenizer = HFTokenizer(folder, extra_eos_ids=(*eos, *_generation_eos(folder)), template_args=chat_template_args)
    return LoadedModel(model=model, tokenizer=tokenizer, name=name, folder=folder, dtype=DTYPES[dtype], weights=mode,
                       backend="native" if use_native else "transformers", activations=activations)


def _check_choices(dtype: str, backend: str, weights: str | None, activations: str) -> None:
    """An `InvalidParameter` for a dtype, backend, weights or activations `load` does not know."""
    if dtype not in DTYPES:
        raise InvalidParameter("dtype", dtype, f"one of {sorted(DTYPES)}")
    if backend not in BACKENDS:
        raise InvalidParameter("backend", backend, f"one of {list(BACKENDS)}")
    if weights not in (None, *WEIGHTS):
        raise InvalidParameter("weights", weights, f"one of {list(WEIGHTS)}")
    if activations not in (*ACTIVATIONS, "auto"):
        raise InvalidParameter("activations", activations, f"one of {[*ACTIVATIONS, 'auto']}")


def _load_native(config: LlamaConfig, folder: str, gguf: str | None, why_dense: str | None, *, dtype: str,
                 device: torch.device, pack: bool | None, fused: bool | None, weights: str | None,
                 activations: str, options: EngineOptions, may_fall_back: bool = False) -> tuple[LanguageModel, str, str]:
    """The native model `load` asked for, its weights (``native``: the GGUF's quantised blocks, or
    ``dense``) and its activations; ``why_dense``: why the blocks cannot be kept here, or None.
    ``may_fall_back`` (``activations="auto"``): q8 asked for where it may run, float (on the same
    native weights) where a layer weight is not one q8 multiplies (an F16 or BF16 one)."""
    q8 = activations == "q8"
    mode = "dense"
    measured: LanguageModel | None = None
    if why_dense is None and weights in (None, "auto") and not q8:
        mode, measured = _auto_weights(gguf, folder, config, dtype, device, pack, fused)  # type: ignore[arg-type]
    elif why_dense is None and (weights == "native" or q8):
        mode = "native"
    blocks = gguf if mode == "native" else None
    model: LanguageModel = measured or _native(config, folder, DTYPES[dtype], device, pack, fused, blocks)
    if q8:
        from metaloom.models.engine.native import with_activations

        try:
            model = with_activations(model, activations)
        except InvalidParameter:
            if not may_fall_back:
                raise
            activations = "float"
    if options != EngineOptions():
        from metaloom.models.engine.llama import LlamaModel

        if not isinstance(model, LlamaModel):  # pragma: no cover - _native builds one
            raise UnsupportedModel(f"engine options need the native LlamaModel, not {type(model).__name__}")
        model = model.with_options(options)
    return model, mode, activations


def native_reason(hf_cfg: Mapping[str, Any]) -> str | None:
    """Why the native engine cannot run a model of this transformers config, or None when it can."""
    if hf_cfg.get("model_type") not in NATIVE_MODEL_TYPES:
        return f"model_type {hf_cfg.get('model_type')!r} (native: {sorted(NATIVE_MODEL_TYPES)})"
    try:
        LlamaConfig.from_hf(hf_cfg)
    except UnsupportedModel as exc:
        return str(exc)
    except (KeyError, TypeError, ValueError) as exc:
        raise NotAModel(f"config.json is not a valid {hf_cfg.get('model_type')} config: {exc!r}") from exc
    return None


def _check_transformers_rope(hf_cfg: Mapping[str, Any], why_native: str | None) -> None:
    """An `UnsupportedModel` naming both backends' lists when the config's RoPE scaling is one
    transformers does not know either (else transformers fails deep in its config class)."""
    from metaloom.models.engine.config import ROPE_TYPES

    params = [hf_cfg.get("rope_scaling") or {}, hf_cfg.get("rope_parameters") or {}]
    params += [p for p in params[1].values() if isinstance(p, dict)]
    kinds = {str(p.get("rope_type", p.get("type"))) for p in params if isinstance(p, dict)} - {"None", "default"}
    if not kinds:
        return
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    known = {"default", "su", *ROPE_INIT_FUNCTIONS}
    unknown = sorted(k for k in kinds if k not in known)
    if unknown:
        raise UnsupportedModel(f"rope scaling type {unknown[0]!r}: neither backend runs it (native: "
                               f"{', '.join(ROPE_TYPES)}; transformers: {', '.join(sorted(known))})"
                               + (f"; native: {why_native}" if why_native and "rope" not in why_native else ""))


def _ids(value: Any) -> tuple[int, ...]:
    return tuple(value) if isinstance(value, list) else ((value,) if value is not None else ())


def _generation_eos(folder: str) -> tuple[int, ...]:
    """The stop tokens of the folder's ``generation_config.json`` (Gemma's <end_of_turn>, Llama
    3's <|eot_id|>), where it has one."""
    try:
        with open(os.path.join(folder, "generation_config.json")) as f:
            return _ids(json.load(f).get("eos_token_id"))
    except (OSError, json.JSONDecodeError, AttributeError):
        return ()


def _refuse_engine_options(options: EngineOptions, model_type: object) -> None:
    """An `InvalidParameter` for an engine option set away from its default on the transformers
    backend: it keeps transformers' own KV cache (the model's dtype, no slot pool, every
    position), so an int8, shared-prefix or KV-policy setting would be silently ignored there."""
    for field, default in (("kv_dtype", "auto"), ("shared_prefix_attention", "auto"), ("kv_policy", "full"),
                           ("kv_budget", None)):
        value = getattr(options, field)
        if value != default:
            want = "unset" if default is None else default
            raise InvalidParameter(field, value, f"{want} with the transformers backend (model type {model_type!r}): "
                                                 "it keeps its own KV cache in the model's dtype; the native "
                                                 "engine's KV pool is what this option sets")


def _why_not_native(gguf: str | None, native_backend: bool, dtype: str, device: torch.device) -> str | None:
    """Why this load cannot keep quantised blocks, or None when it can."""
    if gguf is None:
        return "the model is not a GGUF file (native weights are a GGUF's own blocks)"
    if not native_backend:
        return "the transformers backend dequantises the GGUF"
    if device.type != "cpu":
        return f"the quantised kernels are CPU kernels, not {device.type}"
    if dtype not in ("float32", "bfloat16"):
        return f"native weights compute in float32 or bfloat16, not {dtype}"
    return None


def _auto_weights(gguf: str, folder: str, config: LlamaConfig, dtype: str, device: torch.device,
                  pack: bool | None, fused: bool | None) -> tuple[str, LanguageModel | None]:
    """native or dense, whichever decodes faster here (`metaloom.models.engine.native.choose`), and
    the chosen model when it was just loaded to measure it (None: the choice was recorded)."""
    from metaloom.models.engine.native import choice_path, choose

    built: dict[str, LanguageModel] = {}

    def both() -> tuple[LanguageModel, LanguageModel]:
        built["native"] = _native(config, folder, DTYPES[dtype], device, pack, fused, gguf)
        built["dense"] = _native(config, folder, DTYPES[dtype], device, pack, fused, None)
        return built["native"], built["dense"]

    mode = choose(choice_path(fingerprint(gguf), dtype), dtype, both).weights
    return mode, built.get(mode)


def _native(config: LlamaConfig, folder: str, dtype: torch.dtype, device: torch.device,
            pack: bool | None, fused: bool | None, gguf_blocks: str | None = None) -> LanguageModel:
    """The native model; ``gguf_blocks``: keep that GGUF's quantised blocks (native weights)."""
    from metaloom.models.engine.llama import LlamaModel
    from metaloom.models.kernels.fused import kernels, unsupported_reason
    from metaloom.models.kernels.packed import extra_bytes, fits_in_memory, own_bf16_available, packing_available

    # refuse before reading any weights
    if pack and not packing_available(dtype, device):
        why = " (oneDNN has no bfloat16 kernels for this CPU)" if dtype == torch.bfloat16 and device.type == "cpu" else ""
        raise InvalidParameter("pack", pack, f"False here: no packed kernels for {dtype} on {device}{why}")
    why_not = unsupported_reason(config, dtype, device)
    fused_kernels = None
    if fused is not False and why_not is None:
        available = kernels()
        fused_kernels, why_not = available.kernels, None if available.kernels else available.reason
    if fused and why_not is not None:
        raise InvalidParameter("fused", fused, f"False here: {why_not}")
    if gguf_blocks is None:
        model = LlamaModel.from_state_dict(config, load_state_dict(folder), dtype=dtype, device=device)
    else:
        from metaloom.models.engine.native import blocks_path, read_blocks

        sd, kept = read_blocks(blocks_path(gguf_blocks, folder))
        model = LlamaModel.from_state_dict(config, sd, dtype=dtype, device=device, blocks=kept)  # type: ignore[arg-type]
    if pack is None and not packing_available(dtype, device) and own_bf16_available(dtype, device):
        model = model.own_bf16()  # bfloat16 where oneDNN has no kernels for it: metaloom's own (faster than float32 there)
    elif pack is None:
        pack = packing_available(dtype, device) and fits_in_memory(extra_bytes(model.linear_weight_bytes(), dtype))
    if pack:
        model = model.packed()
    if fused_kernels is not None:
        model = model.with_fused(fused_kernels)
    return model

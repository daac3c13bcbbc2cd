"""Native weights: a GGUF's quantised blocks kept as they are, multiplied by the kernels of
`metaloom.models.kernels.quant` (dequantising in registers), instead of dequantised to ``--dtype``.

Why: a batch-1 decode step reads every weight once, so its speed is bytes per token. SmolLM2's
Q4_1 file holds 0.625 bytes per weight; dequantised to float32 it is 4 bytes, to bfloat16 2.

- **Storage.** The first native load of a GGUF writes its blocks next to the dense conversion
  (`metaloom.models.find.converted_folder`), in ``<folder>/native-<types>/model.safetensors``: each
  kept weight a uint8 tensor [out, row bytes] exactly as the file stores it (rows un-permuted
  for llama's Q/K, like the dense weights), the rest float32, and each kept weight's ggml type
  and input size in the file's metadata. Later loads memory-map it.
- **What is kept.** Every 2-D weight whose type the kernels run (`metaloom.models.kernels.quant_types.QTYPES`:
  Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS, F16, BF16). A weight
  of another type (IQ2/IQ3/IQ1, TQ, MXFP4) is dequantised by `gguf` to float32 and runs dense: exact,
  only larger; a type `gguf` cannot dequantise either is an `UnsupportedModel` naming it and the
  types the kernels read. Norms and biases are always dense. The embedding stays quantised and is
  looked up row by row.
- **Activations** are ``--dtype`` (float32 or bfloat16); the kernels accumulate in float32.
  ``--activations q8`` (`with_activations`) quantises them to int8 per 32 inputs at every
  quantised matmul of the layers and multiplies with integer dot products (quant_q8.h): faster
  for many rows, at a measured quality cost (docs/engine.md); the output head keeps float
  activations (its logits pick the tokens).
- **The default** (``weights=None`` / ``auto``): whichever of native and dense decodes faster at
  batch 1 on this machine, measured once per (GGUF file, dtype, CPU, thread count, kernel path)
  when first needed and recorded in ``choices/`` under the metaloom cache (`choose`).
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch

from metaloom.errors import InvalidParameter, NotAModel, UnsupportedModel
from metaloom.models.paths import user_cache_dir, write_folder
from metaloom.models.protocols import LanguageModel

BLOCKS_FILE = "model.safetensors"
_META_KEY = "metaloom.ggml_types"  # {name: [ggml type id, in_features]}


def kept_types() -> frozenset[int]:
    from metaloom.models.kernels.quant_types import QTYPES

    return frozenset(QTYPES)


def blocks_dir() -> str:
    """The blocks' subfolder, named by the set of types kept: a GGUF converted before the kernels
    read more types is converted again (its new types kept, not dense), never read stale."""
    ids = ",".join(str(t) for t in sorted(kept_types()))
    return "native-" + hashlib.sha256(ids.encode()).hexdigest()[:8]


def blocks_path(gguf_path: str, folder: str) -> str:
    """``folder``'s native blocks file for ``gguf_path``, written on first use (atomically)."""
    from safetensors.torch import save_file

    from metaloom.models.engine.gguf_file import read_gguf_blocks

    target = os.path.join(folder, blocks_dir())
    path = os.path.join(target, BLOCKS_FILE)
    if os.path.exists(path):
        return path

    def write(tmp: str) -> None:
        _, sd, types = read_gguf_blocks(gguf_path, kept_types())
        meta = {name: [qtype, _in_features(sd[name], qtype)] for name, qtype in types.items()}
        save_file({k: v.contiguous() for k, v in sd.items()}, os.path.join(tmp, BLOCKS_FILE),
                  metadata={_META_KEY: json.dumps(meta)})

    write_folder(target, ".native-", write)
    return path


def _in_features(blocks: torch.Tensor, qtype: int) -> int:
    from metaloom.models.kernels.quant_types import QTYPES

    t = QTYPES[qtype]
    return blocks.shape[1] // t.bytes * t.block


def read_blocks(path: str) -> tuple[dict[str, torch.Tensor], dict[str, object]]:
    """(dense tensors, kept weights as `metaloom.models.kernels.quant.QuantWeight`) from a blocks file."""
    from safetensors import safe_open

    from metaloom.models.kernels.quant import QuantWeight

    try:
        with safe_open(path, framework="pt") as f:
            meta = json.loads((f.metadata() or {}).get(_META_KEY, "{}"))
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118  # safe_open has no iterator
    except Exception as exc:  # safetensors raises its own error types on corrupt files
        raise NotAModel(f"{path} is not a readable native-weights file: {exc}") from exc
    kept: dict[str, object] = {}
    for name, (qtype, in_features) in meta.items():
        kept[name] = QuantWeight(int(qtype), tensors.pop(name), int(in_features))
    return tensors, kept


# --- activations --------------------------------------------------------------------------


def with_activations(model: LanguageModel, activations: str) -> LanguageModel:
    """``model`` (a native `LlamaModel` on native weights) with every linear weight of its layers
    multiplying ``activations`` ("float": as it is; "q8": int8 per 32 inputs, integer products).
    A quantised output head takes q8 too (as llama.cpp's does), a Q8_0 one in panels of its own
    (quant_q8_0.h: at 16 rows 2.4x faster than its float products on an AVX-512 VNNI CPU); a
    float head stays float. A tied embedding looks its rows up in the same panels. A layer weight
    that is not quantised blocks (dense float, F16, BF16) is an `InvalidParameter` naming it: q8
    multiplies quants."""
    from metaloom.models.engine.llama import LlamaModel
    from metaloom.models.engine.weights import Concat
    from metaloom.models.kernels.quant import ACTIVATIONS, Q8_TYPES, QuantWeight
    from metaloom.models.kernels.quant_types import QTYPES

    if activations not in ACTIVATIONS:
        raise InvalidParameter("activations", activations, f"one of {list(ACTIVATIONS)}")
    if activations == "float":
        return model
    if type(model) is not LlamaModel:
        raise UnsupportedModel(f"activations={activations!r} needs the native LlamaModel, not {type(model).__name__}")

    def convert(w: Any, name: str) -> Any:
        done = []
        for p in w.parts if isinstance(w, Concat) else (w,):
            if not isinstance(p, QuantWeight) or p.qtype not in Q8_TYPES:
                what = QTYPES[p.qtype].name if isinstance(p, QuantWeight) else f"dense {getattr(p, 'dtype', type(p).__name__)}"
                raise InvalidParameter("activations", activations,
                                       f"float here: q8 multiplies native quantised weights (--weights native), and "
                                       f"{name} is {what}")
            done.append(p.with_activations(activations))
        return Concat(tuple(done)) if isinstance(w, Concat) else done[0]

    layers = [replace(layer, **{f: convert(getattr(layer, f), f"layer {i}'s {f}") for f in ("qkv", "o", "gate_up", "down")})
              for i, layer in enumerate(model.layers)]
    head = model.lm_head
    if isinstance(head, QuantWeight) and head.qtype in Q8_TYPES:
        head = head.with_activations(activations).panelled()
    # tied: one table, not two (a Q8_0 head's panels look rows up too, `QuantWeight.rows`)
    embed = head if model.lm_head is model.embed and isinstance(head, QuantWeight) else model.embed
    return LlamaModel(model.config, embed, layers, model.norm, head, model.fused, model.options)


# --- the default: measured once per machine ----------------------------------------------


@dataclass(frozen=True)
class Choice:
    """Which weights decode faster here, and the measurement behind it."""

    weights: str  # "native" or "dense"
    native_tok_s: float
    dense_tok_s: float
    dtype: str
    threads: int
    tokens: int  # greedy tokens per timing
    repeats: int
    others_per_core: float  # other runnable work per core while it was measured (`busy`)


# Other processes' runnable threads per core above which a measurement is not kept: with the
# cores contended, OpenMP's threads (native weights) and MKL's (dense) slow down by different
# factors (up to 20-60x, docs/performance.md), and a choice measured so (here: dense, 13.6 against
# native's 10.2 tok/s, when native was 7x faster on the quiet machine) would be read back forever.
BUSY = 0.5


def others_per_core() -> float:
    """The 1-minute load average less this process's own runnable thread, per core."""
    return max(0.0, os.getloadavg()[0] - 1.0) / (os.cpu_count() or 1)


def choice_path(fingerprint: str, dtype: str) -> str:
    """Where the choice for one GGUF and dtype is recorded: keyed by the CPU, the thread count,
    PyTorch's version and the kernels' instruction-set path (a path forced lower measures its own
    choice, so a machine never runs the mode that was faster on another path)."""
    from metaloom.models.kernels import isa
    from metaloom.models.kernels.cbuild import cpu_signature

    machine = hashlib.sha256(f"{cpu_signature()}\n{torch.get_num_threads()}\n{torch.__version__}\n"
                             f"{isa.chosen().name}".encode())
    return os.path.join(user_cache_dir("choices"), f"{fingerprint}-{dtype}-{machine.hexdigest()[:12]}.json")


def recorded_choice(path: str) -> Choice | None:
    try:
        with open(path) as f:
            c = Choice(**json.load(f))
    except (OSError, ValueError, TypeError):  # unreadable, or a record from before `others_per_core`
        return None
    return c if c.weights in ("native", "dense") and c.others_per_core <= BUSY else None


def choose(path: str, dtype: str, models: Callable[[], tuple[LanguageModel, LanguageModel]], tokens: int = 24,
           repeats: int = 3) -> Choice:
    """The recorded choice at ``path``, else measure (``models()`` -> (native, dense) models),
    record and return it. A measurement taken while other work kept the cores busy (more than
    ``BUSY`` runnable threads per core, before or after it) is used for this load only and not
    recorded: the next load measures again."""
    found = recorded_choice(path)
    if found is not None:
        return found
    busy = others_per_core()
    native, dense = models()
    times: dict[str, list[float]] = {"native": [], "dense": []}
    for model in (native, dense):
        greedy_seconds(model, tokens)  # warm-up: first-call allocations, kernel loading
    for _ in range(repeats):  # alternate, so drifting load hits both alike
        for name, model in (("native", native), ("dense", dense)):
            times[name].append(greedy_seconds(model, tokens))
    native_s, dense_s = statistics.median(times["native"]), statistics.median(times["dense"])
    busy = max(busy, others_per_core())
    choice = Choice("native" if native_s <= dense_s else "dense", tokens / native_s, tokens / dense_s, dtype,
                    torch.get_num_threads(), tokens, repeats, round(busy, 3))
    if busy > BUSY:
        return choice
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(asdict(choice), f, indent=1)
    os.replace(tmp, path)
    return choice


@torch.inference_mode()
def greedy_seconds(model: LanguageModel, tokens: int, prompt: int = 16) -> float:
    """Seconds for ``tokens`` batch-1 greedy steps after a ``prompt``-token prefill (the
    prefill is not timed): the decode speed the choice is about."""
    cache = model.new_cache(1, prompt + tokens + 1)
    ids = torch.arange(1, prompt + 1, device=model.device)[None]
    token = model.forward(ids, cache, last_only=True)[:, -1].argmax(-1, keepdim=True)
    start = time.perf_counter()
    for _ in range(tokens):
        token = model.forward(token, cache)[:, -1].argmax(-1, keepdim=True)
    return time.perf_counter() - start

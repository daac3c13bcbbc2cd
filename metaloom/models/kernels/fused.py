"""Fused CPU kernels (float32, bfloat16) for the glue of a one-token decode step (`fused.c`).

Why: a batch-1 decode step of SmolLM2-135M in float32 is ~30 ms of matmuls and ~15 ms of some
600 small PyTorch ops (two norms, RoPE, two cache writes, attention over one query, SwiGLU,
two residual adds per layer). Each of those costs microseconds of dispatch for a few hundred
floats of work. `fused.c` does the same arithmetic in three calls per layer:

- `residual_rms_norm`: ``x += delta`` (the residual add, in place) then RMSNorm;
- `rope_attend`: RoPE on q and k, the k/v cache write, and softmax(q K^T / sqrt(D)) V for every
  query head (grouped-query, optional sliding window), one new token per row;
- `silu_mul`: SwiGLU's ``silu(gate) * up`` (`glu_mul`: or GeGLU's tanh-approximated GELU).

The families beyond Llama (`metaloom.models.engine.config`) add per-head q/k norms before RoPE
(`head_rms_norm`), norms of the attention's and the MLP's outputs (`residual_rms_norm` in place),
an attention scale of their own and soft-capped scores (`rope_attend`'s ``scale``, ``softcap``),
and per-layer windows and RoPE tables (each layer's call, or its ``decode_layers`` descriptor).

The matmuls stay PyTorch's. `metaloom.models.engine.llama.LlamaModel` takes this path for one-token
steps when it was given the kernels (`load` does so on the CPU), and for a speculative verify
of a few tokens per row, each token a row of its own (`LlamaModel._verify_fused`); prefill stays
on the PyTorch ops. Keys and values live in the model's KV pool
(`metaloom.models.engine.cache`): `rope_attend` writes every row's new key into its new slot, all
of them before any row attends (so a drafted token attends its ancestors written in the same
call), and reads a row's keys through its slot table, so rows forked from one prompt read the
same keys. With many rows over long caches it splits its work (row x kv head) over PyTorch's
OpenMP threads (fused.c is compiled with OpenMP where the compiler has it). Arithmetic is float32; bfloat16 tensors
are rounded where PyTorch's ops would round them. Results agree with the PyTorch path to float
rounding (tests/test_fused.py).

An int8 KV pool (``--kv-dtype int8``, `metaloom.models.engine.kv_int8`) is read as it is
stored: each key's dot product and each value's weight are multiplied by the slot's scale, and
the new key and value are quantised in C with the Python write's rounding (the same codes for
the same key; tests/test_kv_int8.py).

The C file is compiled on first use with the machine's C compiler (``$CC``, else ``cc``,
``gcc`` or ``clang``) into ``~/.cache/metaloom/kernels/<hash>/`` (about a second), keyed by the
source, the compiler and the CPU, so later processes just load it (`metaloom.models.kernels.cbuild`).
Without a compiler the model runs the PyTorch ops and `kernels()` says why.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

import torch

from metaloom.errors import UnsupportedModel
from metaloom.models.engine.config import LlamaConfig
from metaloom.models.engine.sharing import Sharing
from metaloom.models.kernels import cbuild

SOURCE = Path(__file__).with_name("fused.c")
ABI_VERSION = 9  # must match fused.c
# From this many (row, cached key) pairs per step, fused.c's attention splits over PyTorch's
# threads (OpenMP); below it, one thread (a parallel region costs microseconds per layer).
# Measured with scripts/attention_threads.py (AMD EPYC Zen 4, avx512 and avx2 paths, SmolLM2 and
# Qwen2.5-Coder-0.5B, 2 threads): splitting is level to 1-3% either way below about 250 pairs and
# pays from there (a one-token step at 300 positions 5-8% faster, at 1,000 10-15%; a 2- to 4-token
# verify at 300 positions 6-9%). It was 2048, which kept short decode steps and verifies on one thread.
PARALLEL_MIN_KEYS = 256
MAX_HEAD_DIM = 256  # fused.c keeps a query and its output in 16 vectors of 16
ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}  # fused.c's glu_mul
_P, _I = ctypes.c_void_p, ctypes.c_int64


@dataclass(frozen=True)
class FusedKernels:
    """The loaded library. Every tensor argument must be a contiguous CPU tensor of the
    documented shape, all float32 or all bfloat16 (``lengths`` int64; an int8 pool's keys and
    values int8 with float32 scales). The model's fused step
    guarantees it; these calls check nothing, since a check per call would cost a good part of
    what fusing saves."""

    lib: ctypes.CDLL
    path: str
    openmp: bool = False  # compiled with OpenMP: attention can split over threads
    isa: str = ""  # the instruction-set path it was built for (metaloom.models.kernels.isa)

    def residual_rms_norm(self, x: torch.Tensor, delta: torch.Tensor | None, w: torch.Tensor,
                          y: torch.Tensor, eps: float) -> None:
        """x [R, d] += delta (if given, in place); y [R, d] = RMSNorm(x) * w."""
        self.lib.residual_rms_norm(x.data_ptr(), None if delta is None else delta.data_ptr(), w.data_ptr(),
                                   y.data_ptr(), x.shape[0], x.shape[1], eps, x.dtype == torch.bfloat16)

    def silu_mul(self, gate_up: torch.Tensor, y: torch.Tensor) -> None:
        """gate_up [R, 2 I] = [gate | up]; y [R, I] = silu(gate) * up."""
        self.lib.silu_mul(gate_up.data_ptr(), y.data_ptr(), y.shape[0], y.shape[1], y.dtype == torch.bfloat16)

    def glu_mul(self, gate_up: torch.Tensor, y: torch.Tensor, activation: str) -> None:
        """`silu_mul` with the gate's ``activation``: silu or gelu_tanh (GeGLU)."""
        self.lib.glu_mul(gate_up.data_ptr(), y.data_ptr(), y.shape[0], y.shape[1], ACTIVATIONS[activation],
                         y.dtype == torch.bfloat16)

    def head_rms_norm(self, qkv: torch.Tensor, q_norm: torch.Tensor, k_norm: torch.Tensor, heads: int,
                      kv_heads: int, eps: float) -> None:
        """In place: each query head of qkv [R, (H + 2 H_kv) D] RMS-normalised and scaled by
        q_norm [D], each key head by k_norm [D] (Qwen3, Gemma 3)."""
        self.lib.head_rms_norm(qkv.data_ptr(), q_norm.data_ptr(), k_norm.data_ptr(), qkv.shape[0], heads, kv_heads,
                               q_norm.shape[0], eps, qkv.dtype == torch.bfloat16)

    def rope_attend(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lengths: torch.Tensor,
                    table: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, out: torch.Tensor, heads: int,
                    window: int | None, threads: int = 1, sharing: Sharing | None = None,
                    scales: tuple[torch.Tensor, torch.Tensor] | None = None, drops: Drops | None = None,
                    scale: float | None = None, softcap: float | None = None) -> None:
        """qkv [R, (H + 2 H_kv) D]; cos, sin [positions, D]; lengths [R] int64 (each row's new
        position); table [R, width] int64: the KV slot of each position of each row (the new
        position's slot included); keys, values [slots, H_kv, D]: the layer's KV pool (the new
        key and value are written at the new position's slot); out [R, H D] = attention of the
        rotated queries over positions 0..length (the last ``window`` of them with a sliding
        window). ``threads``: OpenMP threads to split rows x kv heads over (1: this thread).
        ``sharing``: the positions rows share in the pool (`metaloom.models.engine.sharing`),
        attended once for all their queries (shared-prefix attention; not with a sliding window).
        ``scales``: (key scales, value scales) [slots, H_kv] float32 of an int8 pool, whose keys
        and values are then int8 codes (None: they are in ``out``'s dtype). ``drops``: rows that
        dropped positions (``--kv-policy``; not with a sliding window, and its sinks and probs
        not with ``sharing``). ``scale``: what q . k is multiplied by (None: 1 / sqrt(D));
        ``softcap``: scores become softcap * tanh(score / softcap) (not with ``sharing``)."""
        rows, width = table.shape
        _, kv_heads, dim = keys.shape
        ks, vs = (None, None) if scales is None else (scales[0].data_ptr(), scales[1].data_ptr())
        rc = self.lib.rope_attend_ex(qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), lengths.data_ptr(),
                                     table.data_ptr(), width, keys.data_ptr(), values.data_ptr(), ks, vs, out.data_ptr(),
                                     rows, heads, kv_heads, dim, window or 0, threads, out.dtype == torch.bfloat16,
                                     None if sharing is None else ctypes.byref(sharing.desc),
                                     *(drops or NO_DROPS).pointers(), scale or 0.0, softcap or 0.0)
        if rc == -1:
            raise MemoryError("fused attention could not allocate its score buffer")
        if rc == -3:
            raise UnsupportedModel("shared-prefix attention does not apply with a sliding window")
        if rc == -5:
            raise UnsupportedModel("shared-prefix attention does not apply with soft-capped attention scores")
        if rc == -4:
            raise UnsupportedModel("dropped positions do not apply with a sliding window, nor sinks or "
                                   "attention probabilities with shared-prefix attention")
        if rc != 0:
            raise UnsupportedModel(f"fused attention refused head_dim {dim} (at most {MAX_HEAD_DIM})")


@dataclass(frozen=True)
class Drops:
    """What a step of rows that dropped positions (``--kv-policy``,
    `metaloom.models.engine.dropping`) tells the kernels, each None when unused: ``shift`` [R]
    int64, the positions each row dropped (its new token is at length + shift); ``sinks`` [R]
    int64, its leading entries attended at in-cache positions (StreamingLLM); ``probs`` [R,
    H_kv, width] float32, to which each entry's attention probability is added, summed over
    query heads (and over layers, call after call), for H2O. Contiguous CPU tensors."""

    shift: torch.Tensor | None = None
    sinks: torch.Tensor | None = None
    probs: torch.Tensor | None = None

    def pointers(self) -> tuple[int | None, int | None, int | None]:
        return tuple(None if t is None else t.data_ptr() for t in (self.shift, self.sinks, self.probs))  # type: ignore[return-value]


NO_DROPS = Drops()

Availability = cbuild.Availability  # of FusedKernels: the kernels of one path, or why not


def unsupported_reason(config: LlamaConfig, dtype: torch.dtype, device: torch.device) -> str | None:
    """Why the fused step cannot run this model here, or None when it can."""
    if device.type != "cpu":
        return f"the fused kernels are for the CPU, not {device.type}"
    if dtype not in (torch.float32, torch.bfloat16):
        return f"the fused kernels are for float32 and bfloat16, not {dtype}"
    c = config
    if c.hidden_size % 16 or c.intermediate_size % 16:
        return "hidden and intermediate sizes must be multiples of 16"
    if c.head_dim % 32 or c.head_dim > MAX_HEAD_DIM:
        return f"head_dim must be a multiple of 32 and at most {MAX_HEAD_DIM}, not {c.head_dim}"
    if c.num_attention_heads % c.num_key_value_heads:
        return "query heads must be a multiple of key/value heads"
    return None


def _bind(lib: ctypes.CDLL, path: Path, isa: str = "") -> FusedKernels:
    lib.metaloom_fused_abi.restype = ctypes.c_int
    if lib.metaloom_fused_abi() != ABI_VERSION:
        raise OSError(f"{path} has ABI {lib.metaloom_fused_abi()}, expected {ABI_VERSION}")
    lib.residual_rms_norm.argtypes = [_P, _P, _P, _P, _I, _I, ctypes.c_float, ctypes.c_int]
    lib.residual_rms_norm.restype = None
    lib.silu_mul.argtypes = [_P, _P, _I, _I, ctypes.c_int]
    lib.silu_mul.restype = None
    lib.rope_attend.argtypes = [_P, _P, _P, _P, _P, _I, _P, _P, _P, _P, _P, _I, _I, _I, _I, _I, _I, ctypes.c_int, _P, _P, _P, _P]
    lib.rope_attend.restype = ctypes.c_int
    lib.rope_attend_ex.argtypes = [*lib.rope_attend.argtypes, ctypes.c_float, ctypes.c_float]
    lib.rope_attend_ex.restype = ctypes.c_int
    lib.glu_mul.argtypes = [_P, _P, _I, _I, ctypes.c_int, ctypes.c_int]
    lib.glu_mul.restype = None
    lib.head_rms_norm.argtypes = [_P, _P, _P, _I, _I, _I, _I, ctypes.c_float, ctypes.c_int]
    lib.head_rms_norm.restype = None
    lib.metaloom_fused_openmp.restype = ctypes.c_int
    lib.decode_layers.argtypes = [_P, _I, _P, _P, _P, _P, _P, _P, _P, _P, _P, _I, _P, _P, _I, _I, _I, _I, _I, _I, _I,
                                  _I, ctypes.c_float, ctypes.c_int, _P, _P, _P, _P, _P, _P,
                                  ctypes.c_int, ctypes.c_float, ctypes.c_float]  # see metaloom.models.engine.stack
    lib.decode_layers.restype = ctypes.c_int
    return FusedKernels(lib, str(path), bool(lib.metaloom_fused_openmp()), isa)


LIBRARY = cbuild.KernelLibrary(SOURCE, _bind)
build = LIBRARY.build  # (cache_dir, compiler, path): compile (or reuse) and load; a failure is a reason
for_path = LIBRARY.for_path  # one instruction-set path's kernels, loaded once per process
kernels = LIBRARY.current  # the kernels of the path that runs now (metaloom.models.kernels.isa.chosen)


def step_path(model: object) -> str:
    """How ``model`` takes one-token steps, for reports: the fused kernels, or why not."""
    if getattr(model, "fused", None) is not None:
        plan = getattr(model, "_plan", None)
        return "fused kernels, every layer in one call" if callable(plan) and plan(1) is not None else "fused kernels"
    config, embed = getattr(model, "config", None), getattr(model, "embed", None)
    if not isinstance(config, LlamaConfig) or not isinstance(embed, torch.Tensor):
        return f"PyTorch ops: {type(model).__name__} is not the native model"
    why = unsupported_reason(config, embed.dtype, embed.device)
    if why is None:
        available = kernels()
        why = available.reason if available.kernels is None else "turned off (fused=False)"
    return f"PyTorch ops: {why}"

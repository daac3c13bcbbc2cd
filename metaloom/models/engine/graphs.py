"""Static-shape one-token decode steps, captured once per shape as CUDA graphs and replayed.

Why. A decode step of a small or medium model on a GPU is hundreds of small kernels (norms,
RoPE, gathers, the attention, four matmuls a layer): launched one by one from Python, the
launches take longer than the kernels run (issue 35 measured the GPU busy 7-18% of a step).
A CUDA graph records the step's kernels once and replays them with one launch. Replaying needs
every tensor the step reads and writes at a fixed address with a fixed shape, so the step here
reads only static buffers:

- ``tokens`` [R], ``positions`` [R] (each row's length before the step) and ``slots`` [R] (where
  its new key and value go), copied in before each replay;
- ``table`` [R, L]: a device copy of the rows' slot tables (`metaloom.models.engine.cache`). It is
  uploaded whole only when the cache changed in a way a step cannot follow (another cache, a
  multi-token write); a step writes its own new slot into it, as the host table gets it;
- the KV pool's per-layer tensors, and the model's weights and RoPE tables.

The step itself, PyTorch's or Triton's, is `metaloom.models.engine.static_step` (its attention
reads the pool through the table); this module buckets, stages the inputs and captures.

Shapes are bucketed: rows R from `ROW_BUCKETS` and keys L from `key_bucket` (steps of at most
1.5x), so a few dozen graphs cover a run; padded rows write to the pool's scratch slot and are
never read. Each graph is captured on first use of its bucket, after two warm-up runs on the
same inputs (a step is idempotent: it writes the same keys to the same slots). A pool that grew
(new tensors) or a table that must grow drops every graph; they are captured again.

The same code runs uncaptured on any device (``capture=False``): the CPU tests check it there
against the model's own forward. `mode` reads METALOOM_CUDA_GRAPHS (auto: captured on CUDA, not
used on the CPU, where the fused kernels are faster; on: also the uncaptured static step on the
CPU; off: never). A capture that fails logs why and turns the runner off for the model: the
eager step goes on, never silently.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import TYPE_CHECKING

import numpy as np
import torch

from metaloom.errors import InvalidParameter
from metaloom.models.engine.cache import PagedKVCache
from metaloom.models.engine.pool import SCRATCH, KVPool
from metaloom.models.engine.static_step import MAX_WIDTH, Buffers, Step, static_step

if TYPE_CHECKING:
    from metaloom.models.engine.llama import LlamaModel

log = logging.getLogger(__name__)

MODES = ("auto", "on", "off")
ROW_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)
MIN_KEYS = 128
# the most rows a Triton step runs (PyTorch's step above): every bucket, measured beside
# `metaloom.models.engine.static_step.PAGED_ROWS`; METALOOM_TRITON_ROWS lowers it (a benchmark's
# or a different GPU's knob)
TRITON_ROWS = ROW_BUCKETS[-1]


def triton_rows() -> int:
    """METALOOM_TRITON_ROWS (default `TRITON_ROWS`): the most rows a Triton step runs; anything
    but a positive integer is an `InvalidParameter`."""
    raw = os.environ.get("METALOOM_TRITON_ROWS", "").strip()
    if not raw:
        return TRITON_ROWS
    if not raw.isdigit() or int(raw) < 1:
        raise InvalidParameter("METALOOM_TRITON_ROWS", raw, "a positive integer")
    return int(raw)


def mode() -> str:
    """METALOOM_CUDA_GRAPHS: auto (default), on or off; anything else is an `InvalidParameter`."""
    value = os.environ.get("METALOOM_CUDA_GRAPHS", "auto").strip().lower() or "auto"
    if value not in MODES:
        raise InvalidParameter("METALOOM_CUDA_GRAPHS", value, "auto, on or off")
    return value


def row_bucket(rows: int) -> int | None:
    """The smallest row bucket holding ``rows``, or None past the largest."""
    for r in ROW_BUCKETS:
        if rows <= r:
            return r
    return None


def key_bucket(keys: int) -> int:
    """The padded key length for ``keys`` keys: MIN_KEYS, then alternately x1.5 and x4/3
    (128, 192, 256, 384, 512, 768, ...), so at most a third of the attended keys are padding."""
    size = MIN_KEYS
    while size < keys:
        size = size * 3 // 2 if size & (size - 1) == 0 else size * 4 // 3
    return size


def static_forward(m: LlamaModel, tokens: torch.Tensor, cache: object, valid: torch.Tensor | None,
                   last_only: bool = False, tree: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(logits [B, T, V], hidden [B, T, d]) of a decode step (T = 1) or a speculative verify
    (T <= MAX_WIDTH over rows that hold keys already) through `step_graphs`, or None when
    this forward is neither (the caller takes the eager path)."""
    b, t = tokens.shape
    if b == 0 or row_bucket(b) is None or not isinstance(cache, PagedKVCache) or t > MAX_WIDTH:
        return None
    if cache.pool.layers != len(m.layers) or b != cache.batch or (t > 1 and not cache.host_lengths().all()):
        return None  # a prefill of fresh rows takes the eager path (PyTorch's fused attention)
    if tree is not None and (t == 1 or tuple(tree.shape) != (b, t, t) or tree.dtype != torch.bool
                             or m.config.sliding_window is not None or m.options.drops):
        return None  # the eager path checks the tree (a typed error) or takes it
    runner = m.step_graphs(cache.pool)
    if runner is None:
        return None
    keep = [t] * b if valid is None else valid.tolist()
    logits, hidden = runner.run(tokens, cache, keep, None if tree is None else tree.to(tokens.device))
    if last_only:
        last = torch.as_tensor([max(k, 1) - 1 for k in keep], device=logits.device)
        index = torch.arange(b, device=logits.device)
        return logits[index, last][:, None], hidden[index, last][:, None]
    return logits, hidden


def why_not(model: object, pool: KVPool | None = None) -> str | None:
    """Why ``model`` cannot take static steps (over ``pool``, when given) (None: it can): dense
    tensor weights only, and a KV pool stored in the model's own dtype, which the step writes
    and reads as it is (an int8 pool's codes would be read as numbers, its scales ignored)."""
    from metaloom.models.engine.llama import LlamaModel

    if not isinstance(model, LlamaModel):
        return f"static steps are for the native LlamaModel, not {type(model).__name__}"
    if not model.config.plain:
        return (f"static steps run the Llama layer; {model.config.model_type}'s differences (q/k norms, post-norms, "
                "GeGLU, per-layer windows or RoPE, soft-capping, partial RoPE) take the eager step")
    weights = [model.embed, model.lm_head] + [t for w in model.layers for t in (w.qkv, w.o, w.gate_up, w.down)]
    if not all(isinstance(t, torch.Tensor) for t in weights):
        return "static steps need dense tensor weights (quantised or packed ones are CPU kernels)"
    if model.options.drops:
        return (f"static steps keep every position (kv_policy={model.options.kv_policy!r} drops some; the eager "
                "step follows each row's positions)")
    stored = [model.kv_dtype] + ([] if pool is None else [pool.dtype, pool.compute_dtype])
    other = next((d for d in stored if d != model.dtype), None)
    if other is not None:
        return (f"static steps read a KV pool stored in the model's dtype ({model.dtype}), not {other} "
                f"(kv_dtype={model.options.kv_dtype!r}; the eager step converts it)")
    return None


class StepGraphs:
    """A model's static one-token steps over one KV pool: buffers, the table mirror and the
    captured graphs (``capture``: CUDA graphs; False runs the same step uncaptured)."""

    def __init__(self, model: LlamaModel, pool: KVPool, *, capture: bool) -> None:
        self.model, self.pool, self.capture = model, pool, capture
        self.device = pool.device
        self._steps: dict[bool, Step] = {}  # with Triton's fused kernels or not: built on first use
        self.buffers = Buffers.empty(ROW_BUCKETS[-1], MIN_KEYS, self.device)  # every row bucket: rows never regrow
        self.graphs: dict[tuple[int, int, int, bool], tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}
        self.mirror: tuple[int, int] | None = None  # (cache serial, its wide writes) the table holds
        self.pool_key = self._pool_key()
        self.mempool = torch.cuda.graph_pool_handle() if capture else None
        self.captures = 0  # graphs captured so far (recaptures after a pool growth included)
        self.replays = 0
        self.steps = 0  # static steps run, captured or not
        self.uploads = 0  # whole-table uploads (the mirror could not follow the cache)
        self.cuda = self.device.type == "cuda"
        self._staging = torch.empty((0,), dtype=torch.long, pin_memory=self.cuda)  # positions, then slots
        self._copied: torch.cuda.Event | None = None
        self.failure: str | None = None  # why capturing failed (the uncaptured step runs instead)
        self.triton_failure: str | None = None  # why Triton's kernels failed (PyTorch ops run instead)
        self.triton_steps = 0  # static steps run with Triton's kernels
        self.lock = threading.Lock()
        self._chains: dict[int, torch.Tensor] = {}

    def _pool_key(self) -> tuple[int, ...]:
        return tuple(t.data_ptr() for t in self.pool.keys[:1] + self.pool.values[:1])

    def _ensure(self, rows: int, keys: int) -> None:
        """Buffers of at least (rows, keys), keeping what they hold; growing them (new
        addresses) or a grown pool drops the graphs, which read the old ones."""
        key = self._pool_key()
        b = self.buffers
        if key != self.pool_key:
            self._drop()
            self.pool_key = key
        if rows <= b.tokens.shape[0] and keys <= b.table.shape[1]:
            return
        width = keys if keys <= b.table.shape[1] else max(keys, 2 * b.table.shape[1])  # doubling: few regrowths
        grown = Buffers.empty(max(rows, b.tokens.shape[0]), width, self.device)
        grown.table[:b.table.shape[0], :b.table.shape[1]] = b.table
        self.buffers = grown
        self._drop()

    def _drop(self) -> None:
        """Forget every graph. Their memory pool goes with them, and a graph captured into a
        released pool trips PyTorch's allocator (seen on an H100, torch 2.11: "use_count > 0
        INTERNAL ASSERT FAILED"), so the next captures share a fresh one."""
        if self.graphs:
            self.graphs.clear()
            if self.capture:
                self.mempool = torch.cuda.graph_pool_handle()

    def _sync_table(self, cache: PagedKVCache, rows: int, keys: int) -> None:
        """Upload the cache's table when the mirror cannot be current (another cache, or writes
        a step does not mirror); the new position's slot is written by the step itself."""
        state = (cache.serial, cache.wide_writes)
        if state == self.mirror:  # the same cache (a serial keeps its rows), nothing unmirrored since
            return
        width = min(keys, cache.capacity)
        table = torch.from_numpy(np.ascontiguousarray(cache.slots[:rows, :width]))
        self.buffers.table[:rows].zero_()
        self.buffers.table[:rows, :width].copy_(table.to(self.device))
        self.mirror = state
        self.uploads += 1

    def run(self, tokens: torch.Tensor, cache: PagedKVCache, valid: list[int],
            tree: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One step: tokens [B, W] (on the device, W <= MAX_WIDTH); row b keeps its first
        ``valid[b]`` new positions (0: a finished row; the rest go to scratch); ``tree`` [B, W,
        W] bool: a token-tree verify block (each token attends its ancestors and itself, at the
        row's length plus its depth; None: a chain). -> (logits [B, W, V], hidden [B, W, d]),
        fresh tensors. Advances the cache."""
        with self.lock:  # one set of static buffers: steps of two threads over one pool take turns
            return self._run(tokens, cache, valid, tree)

    def _run(self, tokens: torch.Tensor, cache: PagedKVCache, valid: list[int],
             tree: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        b, width = tokens.shape
        positions = cache.host_lengths()
        rows, keys = row_bucket(b), key_bucket(int(positions.max()) + width)
        assert rows is not None and width <= MAX_WIDTH  # the caller checked
        slots = cache.prepare_host(valid, width, mirrored=True)  # may grow the pool: checked next
        self._ensure(rows, keys)
        self._sync_table(cache, b, keys)
        buf = self.buffers
        if self._copied is not None:
            self._copied.synchronize()  # the last step's upload has left the staging buffer
        if self._staging.shape[0] < rows * (1 + width):
            self._staging = torch.empty((rows * (1 + width),), dtype=torch.long, pin_memory=self.cuda)
        stage = self._staging[:rows * (1 + width)]
        stage.fill_(SCRATCH)  # padded rows: position 0, the scratch slot
        stage[:b] = torch.from_numpy(positions)
        stage[rows:rows + b * width] = torch.from_numpy(slots.reshape(-1))
        buf.positions[:rows].copy_(stage[:rows], non_blocking=True)
        buf.slots[:rows, :width].copy_(stage[rows:].view(rows, width), non_blocking=True)
        if self.cuda:
            self._copied = torch.cuda.Event()
            self._copied.record()
        buf.tokens[:b, :width].copy_(tokens)
        if width > 1:
            shape = tree if tree is not None else self._chain(width).expand(b, width, width)
            buf.tree[:b, :width, :width].copy_(shape)
            buf.depths[:b, :width].copy_(shape.sum(-1) - 1)
        if rows > b:
            buf.tokens[b:rows].zero_()
            buf.table[b:rows].zero_()
            if width > 1:  # padded rows: a chain too (each attends something)
                buf.tree[b:rows, :width, :width].copy_(self._chain(width).expand(rows - b, width, width))
                buf.depths[b:rows, :width].copy_(torch.arange(width, device=self.device))
        logits, hidden = self._replay(rows, keys, width)
        self.steps += 1
        cache.advance(valid)
        return logits[:b].clone(), hidden[:b].clone()

    def triton(self) -> bool:
        """Whether this step uses Triton's fused kernels: METALOOM_TRITON (read each step, so a
        benchmark can compare both on one model) allows them here and they have not failed."""
        from metaloom.models.kernels import gpu_triton

        return self.triton_failure is None and gpu_triton.why_not(self.device, self.model.config.head_dim) is None

    def _step_for(self, triton: bool) -> Step:
        step = self._steps.get(triton)
        if step is None:
            step = self._steps[triton] = static_step(self.model, self.pool, triton=triton)
        return step

    def _chain(self, width: int) -> torch.Tensor:
        """[W, W] bool on the device: a chain's block mask (the lower triangle)."""
        chain = self._chains.get(width)
        if chain is None:
            chain = self._chains[width] = torch.ones((width, width), dtype=torch.bool, device=self.device).tril()
        return chain

    def _replay(self, rows: int, keys: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        triton = rows <= triton_rows() and self.triton()
        if triton:
            self.triton_steps += 1
        if not self.capture:
            return self._step_for(triton)(self.buffers, rows, keys, width)
        entry = self.graphs.get((rows, keys, width, triton))
        if entry is None:
            try:
                entry = self._capture(rows, keys, width, triton)
            except Exception as exc:  # an op capture does not support, memory, a driver error
                if triton:  # Triton's kernels first: the PyTorch step may still capture
                    self.triton_failure = f"{type(exc).__name__}: {exc}"
                    self.triton_steps -= 1
                    log.warning("the Triton decode kernels failed (%s); static steps use PyTorch ops from now on",
                                self.triton_failure)
                    return self._replay(rows, keys, width)
                self.failure = f"{type(exc).__name__}: {exc}"
                self._drop()
                self.capture = False
                log.warning("CUDA graph capture failed (%s); decode steps run uncaptured from now on", self.failure)
                return self._step_for(False)(self.buffers, rows, keys, width)
        graph, logits, hidden = entry
        graph.replay()
        self.replays += 1
        return logits, hidden

    def _capture(self, rows: int, keys: int, width: int,
                 triton: bool) -> tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]:
        step = self._step_for(triton)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):  # warm-up: lazy initialisation and workspace allocation happen here
                step(self.buffers, rows, keys, width)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.mempool):
            logits, hidden = step(self.buffers, rows, keys, width)
        self.graphs[(rows, keys, width, triton)] = (graph, logits, hidden)
        self.captures += 1
        return graph, logits, hidden

"""One call of each system of `metaloom bench gpu`, between two device synchronisations: the
shape built (transformers' random-weight model and metaloom's generator on the same tensors) and
freed, each system's call (`metaloom_caller`, `transformers_caller`, `baseline_caller`), and the
check that it generated exactly the tokens its case asks for."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from metaloom.bench import gpu_worker as gw
from metaloom.bench.gpu.baseline import BaselineWorker
from metaloom.bench.gpu.cases import METALOOM_MODES, NO_SPECULATION, Case


@dataclass(frozen=True)
class CallResult:
    seconds: float
    counts: tuple[int, ...]  # tokens per sequence
    digest: str
    ids: tuple[int, ...] | None  # a single sequence's ids (batch-1 greedy), else None
    usage: Any = None  # metaloom's `Usage` of the call (its ledger), where the row keeps it


class TokenCountError(Exception):
    """A system generated another number of tokens than the case asks for (its row's error)."""


def result_of(seconds: float, seqs: Sequence[Sequence[int]]) -> CallResult:
    return CallResult(seconds, tuple(len(s) for s in seqs), gw.digest(seqs), tuple(seqs[0]) if len(seqs) == 1 else None)


def checked(result: CallResult, case: Case) -> CallResult:
    if sum(result.counts) != case.expected_tokens or any(c != case.max_tokens for c in result.counts):
        raise TokenCountError(f"generated {sum(result.counts)} tokens ({len(result.counts)} sequences), "
                              f"expected {case.expected_tokens} ({case.n} x {case.max_tokens})")
    return result


def error_text(exc: BaseException) -> str:
    """A failure as its row says it: the type and the first line of the message."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:300] if text else ''}"


@dataclass
class Shape:
    """A built shape: its config, the transformers model, metaloom's generator and requests."""

    name: str
    cfg: dict[str, Any]
    model: Any
    gen: Any
    requests: dict[str, Any]
    checksum: float
    build_s: float
    compiled: bool = False  # transformers compiled something for this model


def build_shape(name: str, vocab: int, device: str, dtype: str, seed: int, folder: str, cases: Mapping[str, Case]) -> Shape:
    start = time.perf_counter()
    cfg = gw.hf_config(name, vocab)
    model = gw.build_transformers(cfg, device, dtype, seed)
    total = gw.checksum(model)
    gen = gw.metaloom_generator(model, cfg, folder, device, dtype, f"random {name}")
    requests = gw.requests({c.name: c.spec() for c in cases.values()})
    gw.synchronize(device)
    return Shape(name, cfg, model, gen, requests, total, time.perf_counter() - start)


def free_shape(shape: Shape, device: str) -> None:
    if shape.compiled:
        import torch

        torch._dynamo.reset()  # the compiled graphs and their CUDA graph memory
    shape.model = shape.gen = None
    shape.requests = {}
    gw.free_device_memory(device)


def metaloom_caller(system: str, shape: Shape, case: Case, device: str,
                    counts: dict[str, int]) -> Callable[[], CallResult]:
    """``system`` (a key of `METALOOM_MODES`) on ``case``: the engine's graph counters added to
    ``counts`` after each call, and in the speculative case the call's ledger kept."""
    req, mode = shape.requests[case.name], METALOOM_MODES[system]
    spec = gw.ngram_speculative(case.num_draft) if case.num_draft and system in NO_SPECULATION else None
    keep_usage = case.num_draft is not None  # the speculative case's rows report their ledgers

    def metaloom() -> CallResult:
        from metaloom.ledger import Ledger

        before = gw.graph_counters(shape.gen)
        ledger = Ledger()
        result = result_of(*gw.metaloom_call(shape.gen, req, device, mode, ledger=ledger, speculative=spec))
        if keep_usage:
            result = dataclasses.replace(result, usage=ledger.usage)
        after = gw.graph_counters(shape.gen)
        if before is not None and after is not None:
            for k, v in after.items():
                counts[k] = counts.get(k, 0) + v - before.get(k, 0)
            counts["calls"] = counts.get("calls", 0) + 1
        return result
    return metaloom


def transformers_caller(system: str, shape: Shape, case: Case, device: str,
                        static_compile: list[bool]) -> Callable[[], CallResult]:
    """transformers ``generate``: ``tf-eager`` with its dynamic cache, ``tf-static`` with a static
    cache, compiled while ``static_compile[0]`` holds (read at each call: a failed compilation
    turns it off for the row's later calls)."""
    if system == "tf-eager":
        return lambda: result_of(*gw.transformers_call(shape.model, case.spec(), device))
    return lambda: result_of(*gw.transformers_call(shape.model, case.spec(), device, static=True,
                                                   compile=static_compile[0]))


def baseline_caller(worker: BaselineWorker, case: Case, timeout_s: float) -> Callable[[], CallResult]:
    """The older package's call in the worker (which holds the shape already)."""
    def baseline_call() -> CallResult:
        r = worker.request({"op": "run", "case": case.name}, timeout_s=timeout_s)
        ids = r.get("ids")
        return CallResult(float(r["seconds"]), tuple(r["tokens"]), str(r["digest"]), tuple(ids) if ids else None)
    return baseline_call

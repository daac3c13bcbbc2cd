"""A prompt's prefill through the fused kernels (each token a row of its own, `fused_step`)
against the PyTorch ops (SDPA's blocked attention, `eager`), on one model, in one process: for
each prompt length the two paths alternate, median of ``--repeats`` prefills each (logits of the
last position only, as generation asks), and the ratio. Also checks that the fused prefill's
last logits equal, bit for bit, those of feeding the same prompt one token at a time (on a
quantised head), which the eager path does only to rounding. The lengths where the ratio falls
under 1 set `fused_step.FUSED_PREFILL_KEYS`; the figures in docs/performance.md come from it.

usage: python scripts/prefill_paths.py [--model SPEC] [--activations q8|float] [--lengths 100,200,...]
    [--repeats N]   (METALOOM_ISA=avx2 for the avx2 path)"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from metaloom.models import load
from metaloom.models.engine import fused_step
from metaloom.models.kernels.isa import cpu_name


def _prefill_ms(model, ids: torch.Tensor, fused: bool) -> float:
    """One prefill of ``ids`` [1, n] on a fresh cache, through the path asked for."""
    keep = fused_step.FUSED_PREFILL_KEYS, fused_step.FUSED_PREFILL_KEYS_ELSEWHERE
    fused_step.FUSED_PREFILL_KEYS, fused_step.FUSED_PREFILL_KEYS_ELSEWHERE = ({}, 1 << 30) if fused else ({}, 0)
    try:
        cache = model.new_cache(1, ids.shape[1] + 1)
        assert model._verify_applies(cache, ids.shape[1], None) == fused
        start = time.perf_counter()
        model.forward(ids, cache, last_only=True)
        took = time.perf_counter() - start
        cache.release()
        return took * 1e3
    finally:
        fused_step.FUSED_PREFILL_KEYS, fused_step.FUSED_PREFILL_KEYS_ELSEWHERE = keep


def _steps_equal(model, ids: torch.Tensor) -> bool:
    """Whether the fused prefill's last logits are the one-token steps' bits."""
    keep = fused_step.FUSED_PREFILL_KEYS
    fused_step.FUSED_PREFILL_KEYS = {model.fused.isa: 1 << 30}
    try:
        cache = model.new_cache(1, ids.shape[1] + 1)
        whole = model.forward(ids, cache, last_only=True)[0, -1]
        cache.release()
    finally:
        fused_step.FUSED_PREFILL_KEYS = keep
    cache = model.new_cache(1, ids.shape[1] + 1)
    for i in range(ids.shape[1]):
        last = model.forward(ids[:, i:i + 1], cache)[0, -1]
    cache.release()
    return bool(torch.equal(whole, last))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default")
    p.add_argument("--activations", default="q8", choices=["q8", "float"])
    p.add_argument("--lengths", default="100,200,400,800,1024,1600")
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args()
    loaded = load(a.model, weights="native", activations=a.activations)
    model = loaded.model
    if model.fused is None:
        raise SystemExit("no fused kernels here")
    print(f"{a.model}, native weights, {a.activations} activations; {cpu_name()}, {model.fused.isa} path, "
          f"{torch.get_num_threads()} threads; prefill keys limit here: {fused_step.prefill_keys(model.fused.isa)}")
    gen = torch.Generator().manual_seed(0)
    for n in (int(v) for v in a.lengths.split(",")):
        ids = torch.randint(100, model.vocab_size - 1, (1, n), generator=gen)
        _prefill_ms(model, ids, True), _prefill_ms(model, ids, False)  # warm-up
        times: dict[bool, list[float]] = {True: [], False: []}
        for _ in range(a.repeats):
            for fused in (True, False):
                times[fused].append(_prefill_ms(model, ids, fused))
        f, e = statistics.median(times[True]), statistics.median(times[False])
        exact = _steps_equal(model, ids) if n <= 400 else None
        print(f"{n:5d} tokens: fused {f:8.1f} ms, PyTorch ops {e:8.1f} ms, fused {e / f:.2f}x"
              + ("" if exact is None else f"; fused = one-token steps to the bit: {exact}"))


if __name__ == "__main__":
    main()

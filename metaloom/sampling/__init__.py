"""Sampling: validated parameters and the one ordered logits pipeline.

`SamplingParams` is plain data (no torch); the pipeline (`Sampler`, `make_sampler`,
`SamplingState`) is imported on first use, so request types stay importable without torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from metaloom.sampling.params import SamplingParams

if TYPE_CHECKING:
    from metaloom.sampling.pipeline import Sampler, make_sampler
    from metaloom.sampling.state import SamplingState

_LAZY = {"Sampler": "metaloom.sampling.pipeline", "make_sampler": "metaloom.sampling.pipeline",
         "SamplingState": "metaloom.sampling.state"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["Sampler", "SamplingParams", "SamplingState", "make_sampler"]

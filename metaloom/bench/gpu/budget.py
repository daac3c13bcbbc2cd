"""The time guard of `metaloom bench gpu`: the run's budget (`Budget`), and what a call, a
shape's build and a compilation are expected to cost (`Estimator`: a prior from the shape and
the copy bandwidth, scaled by what was measured so far), so that what does not fit is skipped
with reason "time budget" instead of cutting the run short."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from metaloom.bench import gpu_worker as gw
from metaloom.bench.gpu.cases import TRANSFORMERS, Case

RESERVE_S = 5.0  # kept back from the budget: freeing, the report


@dataclass
class Budget:
    """Seconds for the whole run, from ``start`` (`time.monotonic`)."""

    total_s: float
    start: float = field(default_factory=time.monotonic)
    compile_spent_s: float = 0.0

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def left(self) -> float:
        return self.total_s - RESERVE_S - self.elapsed()

    def fits(self, seconds: float) -> bool:
        return seconds <= self.left()


@dataclass
class Estimator:
    """Seconds of a call and a build: a prior scaled by what was measured, each system's
    (and the builds') largest ratio of measured (median) to prior seen so far, times a margin;
    a compilation: the longest seen so far, times the margin."""

    device_type: str
    copy_gbs: float
    compile_s: float
    margin: float = 1.25
    ratios: dict[str, list[float]] = field(default_factory=dict)

    def _scale(self, key: str, floor: float = 0.0) -> float:
        seen = self.ratios.get(key)
        return max(floor, max(seen) * self.margin) if seen else 1.0

    def observe(self, key: str, prior: float, actual: float) -> None:
        if prior > 0:
            self.ratios.setdefault(key, []).append(actual / prior)

    def prior_call(self, system: str, cfg: Mapping[str, Any], case: Case) -> float:
        """A rough, deliberately high guess of one call's seconds."""
        layers, rows = cfg["num_hidden_layers"], case.n
        params = gw.parameter_count(cfg)
        if self.device_type == "cuda":
            step = layers * 0.3e-3 + 3e-3 + rows * 0.12e-3 + gw.step_weight_bytes(cfg) / (0.5 * self.copy_gbs * 1e9)
            prefill = 0.1 + 2 * params * len(case.prompt_ids) * (rows if system in TRANSFORMERS else 1) / 2e14
        else:
            step = layers * 2e-3 + 10e-3 + rows * 1e-3 + 2 * params * rows / 2e10
            prefill = 2 * params * len(case.prompt_ids) * (rows if system in TRANSFORMERS else 1) / 2e10
        factor = 1.5 if system in TRANSFORMERS else 1.0
        return factor * (case.max_tokens * step + prefill)

    def call(self, system: str, cfg: Mapping[str, Any], case: Case) -> tuple[float, float]:
        """(estimated seconds, the prior it scales)."""
        prior = self.prior_call(system, cfg, case)
        return prior * self._scale(system), prior

    def prior_build(self, cfg: Mapping[str, Any]) -> float:
        return (3.0 if self.device_type == "cuda" else 5.0) + gw.parameter_count(cfg) / 1e9 * 2.0

    def build(self, cfg: Mapping[str, Any]) -> tuple[float, float]:
        prior = self.prior_build(cfg)
        return prior * self._scale("build", 1.0), prior

    def compile(self) -> float:
        """The longest compiling warm-up seen so far (a margin added), else ``compile_s``."""
        seen = self.ratios.get("compile")
        return max(seen) * self.compile_s * self.margin if seen else self.compile_s

"""Coverage against samples as an exponentiated power law (Brown et al. 2024, "Large Language
Monkeys: Scaling Inference Compute with Repeated Sampling", section 3): the fraction of
problems some sample solves, c(k), is modelled as

    log c(k) ≈ a · k^b        (a < 0, b < 0: c rises towards 1 as k grows)

fitted by least squares on log coverage, as the paper fits it.

The fit (`fit_power_law`) is exact least squares by variable projection: for a fixed b the
best a is linear, a(b) = Σ y_i x_i^b / Σ x_i^(2b) (y = log c, x = k), so the residual sum of
squares is a function of b alone, minimised over a fine grid and refined by golden-section
search. Two parameters need no general optimiser (and no SciPy).

`coverage_fit` reads a sweep: each pool of samples (the pooled specs that share one draw have
one coverage curve; the first such spec names it) gives per problem the unbiased pass@k
(`subsample.pass_at_k`) at k = 1, 2, 4, ..., n; the mean over problems is the curve fitted.
Residuals are given on the fitted scale (log coverage) and as coverage (fraction of problems).
Intervals on a and b: percentile bootstrap over problems (`curves.interval`'s convention:
resample the problems, refit), so a curve measured on 30 problems says how loosely it pins
the exponent.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from metaloom.errors import InvalidParameter
from metaloom.eval.analysis.curves import latest, sizes
from metaloom.eval.analysis.subsample import pass_at_k
from metaloom.eval.records import POOLED, Record
from metaloom.wiring.spec import parse_spec

B_RANGE = (-4.0, 4.0)  # the exponents searched; coverage curves sit well inside (Brown et al.: about -0.1 .. -0.7)
GRID = 1601


def _sse(b: np.ndarray, x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(a(b), residual sum of squares) for each exponent in ``b`` (vectorised)."""
    xb = x[None, :] ** b[:, None]
    a = (xb * y[None, :]).sum(axis=1) / (xb * xb).sum(axis=1)
    resid = y[None, :] - a[:, None] * xb
    return a, (resid * resid).sum(axis=1)


def fit_power_law(k: Sequence[float], coverage: Sequence[float]) -> tuple[float, float]:
    """(a, b) minimising Σ (log c_i − a·k_i^b)² over the points with 0 < c_i (log 0 is
    undefined: a point where no problem is covered carries no information on this scale).
    Needs at least two such points at distinct k; else `InvalidParameter`."""
    x = np.asarray(k, dtype=np.float64)
    c = np.asarray(coverage, dtype=np.float64)
    if x.shape != c.shape or x.ndim != 1:
        raise InvalidParameter("coverage", (x.shape, c.shape), "one coverage per k")
    keep = (c > 0) & np.isfinite(c) & (x > 0)
    x, y = x[keep], np.log(np.minimum(c[keep], 1.0))
    if len(set(x.tolist())) < 2:
        raise InvalidParameter("coverage", coverage, "positive coverage at two distinct k at least, to fit a power law")
    if not np.any(y < 0):  # every point covered in full: log c = 0 = a·k^b with a = 0, any b
        return 0.0, 0.0
    grid = np.linspace(*B_RANGE, GRID)
    _, sse = _sse(grid, x, y)
    i = int(np.argmin(sse))
    lo, hi = grid[max(i - 1, 0)], grid[min(i + 1, GRID - 1)]
    ratio = (math.sqrt(5) - 1) / 2
    for _ in range(60):  # golden section inside the bracketing grid cells
        m1, m2 = hi - ratio * (hi - lo), lo + ratio * (hi - lo)
        s = _sse(np.array([m1, m2]), x, y)[1]
        if s[0] <= s[1]:
            hi = m2
        else:
            lo = m1
    b = (lo + hi) / 2
    a = float(_sse(np.array([b]), x, y)[0][0])
    return a, float(b)


def predict(a: float, b: float, k: Sequence[float]) -> list[float]:
    """exp(a · k^b) at each k."""
    return [math.exp(a * float(x) ** b) for x in k]


def pools(records: Sequence[Record]) -> list[tuple[str, list[tuple[str, int, int]]]]:
    """One entry per distinct pool: (the first pooled spec that reads it, [(problem, n, c)])
    where n is the pool's size and c its correct samples. Specs whose (problem, n, c) agree on
    every problem (strategies sharing one draw) are one pool."""
    table = latest(records)
    out: list[tuple[str, list[tuple[str, int, int]]]] = []
    seen: set[tuple[tuple[str, int, int], ...]] = set()
    for spec in dict.fromkeys(r.strategy for r in records):
        if parse_spec(spec).name not in POOLED:
            continue
        rows = [(r.problem, len(r.candidates), sum(c.correct for c in r.candidates))
                for (p, s), r in table.items() if s == spec and r.candidates and r.error is None]
        key = tuple(sorted(rows))
        if rows and key not in seen:
            seen.add(key)
            out.append((spec, rows))
    return out


def _curve(counts: np.ndarray, ks: Sequence[int]) -> np.ndarray:
    """Per k, per problem pass@k (problems as rows of ``counts``: n, c)."""
    return np.array([[pass_at_k(int(n), int(c), min(k, int(n))) for n, c in counts] for k in ks], dtype=np.float64)


def coverage_fit(records: Sequence[Record], *, seed: int = 0, bootstrap: int = 1000) -> list[dict[str, Any]]:
    """Per pool (`pools`): ``spec``, ``problems``, ``k``, the mean ``coverage`` at each k, the
    fitted ``a`` and ``b`` with bootstrap 95% intervals (``a_lo`` ...; None where a resample
    cannot be fitted too often: under half fitted), the ``fitted`` coverage, residuals
    ``residual_log`` (log c − a·k^b) and ``residual`` (c − exp(a·k^b)), and their root mean
    squares. A pool whose curve cannot be fitted (under two k with any coverage) has
    ``a`` None and ``reason``."""
    out = []
    for spec, rows in pools(records):
        n_max = max(n for _, n, _ in rows)
        ks = sizes(n_max)
        counts = np.array([(n, c) for _, n, c in rows], dtype=np.int64)
        per = _curve(counts, ks)  # k x problems
        mean = [float(c) for c in per.mean(axis=1)]
        entry: dict[str, Any] = {"spec": spec, "problems": len(rows), "k": ks, "coverage": mean}
        try:
            a, b = fit_power_law(ks, mean)
        except InvalidParameter as exc:
            entry.update(a=None, b=None, reason=exc.allowed)
            out.append(entry)
            continue
        fitted = predict(a, b, ks)
        with np.errstate(divide="ignore"):
            log_resid = [math.log(c) - a * k**b if c > 0 else math.nan for c, k in zip(mean, ks, strict=True)]
        resid = [c - f for c, f in zip(mean, fitted, strict=True)]
        finite_log = [r for r in log_resid if math.isfinite(r)]
        entry.update(a=a, b=b, fitted=fitted, residual_log=log_resid, residual=resid,
                     rms_log=math.sqrt(sum(r * r for r in finite_log) / len(finite_log)),
                     rms=math.sqrt(sum(r * r for r in resid) / len(resid)), reason=None)
        entry.update(_bootstrap(per, ks, seed=seed, bootstrap=bootstrap))
        out.append(entry)
    return out


def _bootstrap(per: np.ndarray, ks: Sequence[int], *, seed: int, bootstrap: int) -> dict[str, float | None]:
    """Percentile 95% intervals of a and b over problem resamples (refit each)."""
    m = per.shape[1]
    rng = np.random.default_rng([seed, m, 49])
    fits = []
    for idx in rng.integers(0, m, size=(bootstrap, m)):
        try:
            fits.append(fit_power_law(ks, per[:, idx].mean(axis=1).tolist()))
        except InvalidParameter:
            continue
    if len(fits) < bootstrap / 2:
        return {"a_lo": None, "a_hi": None, "b_lo": None, "b_hi": None}
    arr = np.array(fits)
    (a_lo, a_hi), (b_lo, b_hi) = np.percentile(arr[:, 0], [2.5, 97.5]), np.percentile(arr[:, 1], [2.5, 97.5])
    return {"a_lo": float(a_lo), "a_hi": float(a_hi), "b_lo": float(b_lo), "b_hi": float(b_hi)}

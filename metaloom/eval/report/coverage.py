"""The report's coverage-scaling section: each sample pool's coverage against samples k with
the exponentiated power law fitted to it (Brown et al. 2024; `metaloom.eval.analysis.scaling`)
and the residuals underneath, plus a table of the fitted parameters with their bootstrap
intervals. Pure: it reads the analysis's ``coverage_fit``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, NullFormatter

from metaloom.eval.report.figure_layout import PALETTE
from metaloom.eval.report.figures import data_uri
from metaloom.present.numbers import finite


def _plain(v: float, _pos: Any = None) -> str:
    return f"{v:g}"


def draw_fit(fits: Sequence[Mapping[str, Any]]) -> Figure | None:
    """Top: coverage (markers) and exp(a·k^b) (line) against k, log₂ axis; bottom: residuals
    (coverage − fit) in points. Pools without a fit are left out; None when none has one."""
    fitted = [f for f in fits if finite(f.get("a")) and finite(f.get("b"))]
    if not fitted:
        return None
    fig = Figure(figsize=(7.5, 4.6))
    top, bottom = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [3, 1.3]})
    for i, f in enumerate(fitted):
        color = PALETTE[i % len(PALETTE)]
        k = np.asarray(f["k"], dtype=np.float64)
        dense = np.geomspace(k.min(), k.max(), 200)
        label = f"{f['spec']}: exp({f['a']:.3g}·k^{f['b']:.3g})"
        top.plot(k, f["coverage"], "o", color=color, markersize=5)
        top.plot(dense, np.exp(f["a"] * dense ** f["b"]), "-", color=color, linewidth=1.5, label=label)
        bottom.plot(k, [100 * r for r in f["residual"]], "o-", color=color, markersize=4, linewidth=1)
    bottom.axhline(0.0, color="#888888", linewidth=0.8)
    top.set_ylabel("coverage (fraction of problems)", fontsize=9)
    bottom.set_ylabel("residual (points)", fontsize=9)
    bottom.set_xlabel("samples per problem k (log₂ scale)", fontsize=9)
    for ax in (top, bottom):
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(FuncFormatter(_plain))
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.grid(True, alpha=0.35)
        ax.tick_params(labelsize=8)
    top.legend(fontsize=8, loc="upper left", frameon=False)
    return fig


def _interval(lo: Any, hi: Any) -> str:
    return f"[{lo:.3g}, {hi:.3g}]" if finite(lo) and finite(hi) else ""


def coverage_fit_view(analysis: Mapping[str, Any]) -> dict[str, Any]:
    """The figure (a data URI, or None) and one table row per pool: its spec, problems,
    largest k, fitted a and b with 95% intervals, RMS residuals, or why there is no fit."""
    fits = list(analysis.get("coverage_fit") or ())
    rows = []
    for f in fits:
        fitted = finite(f.get("a"))
        rows.append({"spec": f.get("spec"), "problems": f.get("problems"), "k": max(f.get("k") or [0]),
                     "a": f"{f['a']:.3f}" if fitted else "–", "a_interval": _interval(f.get("a_lo"), f.get("a_hi")),
                     "b": f"{f['b']:.3f}" if fitted else "–", "b_interval": _interval(f.get("b_lo"), f.get("b_hi")),
                     "rms": f"{100 * f['rms']:.2f}" if finite(f.get("rms")) else "–",
                     "rms_log": f"{f['rms_log']:.3f}" if finite(f.get("rms_log")) else "–",
                     "reason": f.get("reason") or ""})
    fig = draw_fit(fits)
    return {"rows": rows, "figure": None if fig is None else data_uri(fig)}

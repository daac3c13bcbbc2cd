"""The report's figures, drawn with matplotlib and returned as ``data:image/png;base64,...``
URIs, so the HTML file carries them inside itself (no file beside it, nothing fetched).

Each figure is drawn on its own `matplotlib.figure.Figure` with the Agg canvas, never through
pyplot: no global backend is switched, no window opens, and nothing is left in pyplot's list
of open figures when a long-lived process (a notebook, the server) builds a report.

Inputs are the analysis dict's parts (``curves``, ``frontier``, ``selection``) or small
tables `build` prepares; every function returns None when it has nothing to draw, so the
page can say so instead of showing an empty frame.
"""

from __future__ import annotations

import base64
import io
import math
from collections.abc import Mapping, Sequence
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import EngFormatter, FuncFormatter, LogLocator, MaxNLocator, NullFormatter

# (point field, axis label with its unit) for the three costs a curve is drawn against
COST_AXES = (
    ("output_tokens", "mean output tokens per problem (tokens)"),
    ("flops", "mean compute per problem (FLOPs)"),
    ("seconds", "mean wall time per problem (s)"),
)
ACCURACY_LABEL = "accuracy (fraction correct)"
DPI = 120  # 1 inch of figure = 120 px: sharp at the page's 1200 px width without a heavy file
PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
           "#bcbd22", "#17becf")
FRONTIER_COLOR = "#111111"
# the vote summary's outcome classes, in stacking order, with their colours
VOTE_OUTCOMES = (
    ("chosen answer correct", "#2ca02c"),
    ("correct answer outvoted", "#ff7f0e"),
    ("no vote correct", "#d62728"),
    ("no votes", "#bbbbbb"),
)


def data_uri(fig: Figure) -> str:
    """The figure as an embeddable PNG data URI (base64)."""
    FigureCanvasAgg(fig)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=DPI, bbox_inches="tight", facecolor="white")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def family_colors(families: Sequence[str]) -> dict[str, str]:
    """One colour per family, fixed by its place in ``families``: the same family has the same
    colour in every figure of the report."""
    return {f: PALETTE[k % len(PALETTE)] for k, f in enumerate(families)}


def _positive(v: Any) -> bool:
    """A cost a log axis can place: a finite number above zero (0 or null cost, e.g. a scripted
    generator that counts no FLOPs, has no place on it)."""
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) and v > 0


def _number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def _interval(point: Mapping[str, Any], key: str) -> tuple[float, float]:
    """The point's 95% interval for ``key`` (accuracy or coverage); the value itself where the
    analysis gave none."""
    value = float(point[key])
    lo: Any = point.get(f"{key}_lo")
    hi: Any = point.get(f"{key}_hi")
    return (float(lo) if _number(lo) else value, float(hi) if _number(hi) else value)


def _draw_family(ax: Any, points: Sequence[Mapping[str, Any]], x_key: str, y_key: str, color: str, label: str,
                 dashed: bool = False) -> int:
    """One family's points on ``ax``: a line with its 95% band where there are two or more, a
    marker with an error bar for a single point. Returns how many points had no place (no
    positive x, no y)."""
    placed = sorted(((float(p[x_key]), p) for p in points if _positive(p.get(x_key)) and _number(p.get(y_key))),
                    key=lambda xp: xp[0])
    if not placed:
        return len(points)
    xs = [x for x, _ in placed]
    ys = [float(p[y_key]) for _, p in placed]
    bands = [_interval(p, y_key) for _, p in placed]
    style = "--" if dashed else "-"
    if len(placed) > 1:
        ax.plot(xs, ys, style, color=color, marker="o", markersize=4, linewidth=1.6, label=label)
        ax.fill_between(xs, [b[0] for b in bands], [b[1] for b in bands], color=color, alpha=0.15 if not dashed else 0.07,
                        linewidth=0)
    else:
        ax.errorbar(xs, ys, yerr=[[ys[0] - bands[0][0]], [bands[0][1] - ys[0]]], fmt="s" if not dashed else "d",
                    color=color, markersize=6, capsize=3, label=label)
    return len(points) - len(placed)


def _draw_frontier(ax: Any, labels: Sequence[str], by_label: Mapping[str, Mapping[str, Any]], x_key: str) -> bool:
    """The Pareto frontier on ``ax``: ringed points joined by a dashed black step line."""
    placed = [(float(by_label[lab][x_key]), float(by_label[lab]["accuracy"])) for lab in labels
              if lab in by_label and _positive(by_label[lab].get(x_key)) and _number(by_label[lab].get("accuracy"))]
    if not placed:
        return False
    placed.sort()
    xs, ys = [x for x, _ in placed], [y for _, y in placed]
    ax.step(xs, ys, where="post", color=FRONTIER_COLOR, linestyle=":", linewidth=1.2, zorder=4)
    ax.scatter(xs, ys, s=110, facecolors="none", edgecolors=FRONTIER_COLOR, linewidths=1.6, zorder=5,
               label="Pareto frontier")
    return True


def _plain(v: float, _pos: Any = None) -> str:
    return f"{v:g}"


# tick labels per cost: FLOPs and tokens in engineering units (4G, 20k), seconds as numbers
TICK_FORMATS: dict[str, Any] = {"flops": lambda: EngFormatter(sep=""), "output_tokens": lambda: EngFormatter(sep=""),
                                "seconds": lambda: FuncFormatter(_plain), "k": lambda: FuncFormatter(_plain)}


def _log_ticks(ax: Any, key: str) -> None:
    """Labels at 1, 2 and 5 times each power of ten only: matplotlib's default labels every
    minor tick on a short log axis, and they run into each other."""
    ax.xaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.xaxis.set_major_formatter(TICK_FORMATS.get(key, lambda: FuncFormatter(_plain))())
    ax.xaxis.set_minor_formatter(NullFormatter())


def _style_axes(ax: Any, xlabel: str, ylabel: str | None, key: str = "") -> None:
    ax.set_xscale("log")
    _log_ticks(ax, key)
    ax.set_xlabel(xlabel, fontsize=9)
    if ylabel:
        ax.set_ylabel(ylabel, fontsize=9)
    ax.set_ylim(-0.03, 1.03)
    ax.grid(True, which="major", alpha=0.35)
    ax.grid(True, which="minor", alpha=0.12)
    ax.tick_params(labelsize=8)


def _legend_below(fig: Figure, axes: Sequence[Any]) -> None:
    """One legend for all panels, under them, without repeats."""
    seen: dict[str, Any] = {}
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            seen.setdefault(label, handle)
    if seen:
        labels = [wrap_label(k) for k in seen]
        widest = max(len(line) for label in labels for line in label.splitlines())
        # a long spec would widen the legend, and with it the whole figure, which the page then
        # shrinks: long labels wrap at commas and take fewer columns
        ncol = min(len(seen), 5 if widest <= 30 else 3 if widest <= 45 else 2)
        # hung below the figure (the tight bounding box of the saved PNG takes it in), so
        # however many lines it has it never covers the axes
        fig.legend(list(seen.values()), labels, loc="upper center", ncol=ncol, fontsize=8.5,
                   frameon=False, bbox_to_anchor=(0.5, 0.02))


def wrap_label(label: str, width: int = 40) -> str:
    """``label`` on lines of at most about ``width`` characters, broken after commas."""
    lines: list[str] = []
    for part in label.replace(",", ",\0").split("\0"):
        if lines and len(lines[-1]) + len(part) <= width:
            lines[-1] += part
        else:
            lines.append(part)
    return "\n".join(lines)


def accuracy_figure(curves: Sequence[Mapping[str, Any]], frontier: Mapping[str, Sequence[str]],
                    colors: Mapping[str, str]) -> tuple[str, int] | None:
    """Accuracy against each cost (output tokens, FLOPs, seconds; log x), one line per family
    with its 95% band, the Pareto frontier of that cost ringed. Returns the figure and how
    many (point, cost) pairs were left out for having no positive cost; None without points."""
    points = [p for c in curves for p in c.get("points") or ()]
    if not points:
        return None
    by_label = {p["label"]: p for p in points if "label" in p}
    fig = Figure(figsize=(13, 4.3))
    axes = fig.subplots(1, len(COST_AXES), sharey=True)
    missing = 0
    for k, (ax, (key, xlabel)) in enumerate(zip(axes, COST_AXES, strict=True)):
        drawn = False
        for curve in curves:
            pts = curve.get("points") or []
            left = _draw_family(ax, pts, key, "accuracy", colors.get(curve["family"], PALETTE[0]), curve["family"])
            missing += left
            drawn = drawn or left < len(pts)
        _draw_frontier(ax, frontier.get(key) or (), by_label, key)
        if drawn:
            _style_axes(ax, xlabel, ACCURACY_LABEL if k == 0 else None, key)
        else:
            ax.set_xlabel(xlabel, fontsize=9)
            ax.text(0.5, 0.5, "no positive cost measured", ha="center", va="center", transform=ax.transAxes,
                    fontsize=9, color="#666666")
            ax.set_xticks([])
            if k == 0:
                ax.set_ylabel(ACCURACY_LABEL, fontsize=9)
    fig.subplots_adjust(wspace=0.08, bottom=0.2)
    _legend_below(fig, axes)
    return data_uri(fig), missing


def coverage_figure(curves: Sequence[Mapping[str, Any]], colors: Mapping[str, str]) -> str | None:
    """Coverage (pass@k: some sample is correct) against samples k, solid with its band, and
    the family's accuracy at the same k dashed: the gap between them is what the selection
    (the vote, the scorer) loses. Families without k or coverage are left out; None when none
    has them."""
    fig = Figure(figsize=(7.5, 3.6))
    ax = fig.subplots()
    drawn = False
    for curve in curves:
        pts = [p for p in curve.get("points") or () if _positive(p.get("k")) and _number(p.get("coverage"))]
        if not pts:
            continue
        color = colors.get(curve["family"], PALETTE[0])
        _draw_family(ax, pts, "k", "coverage", color, f"{curve['family']} coverage")
        _draw_family(ax, pts, "k", "accuracy", color, f"{curve['family']} accuracy", dashed=True)
        drawn = True
    if not drawn:
        return None
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(FuncFormatter(_plain))
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("samples per problem k (log₂ scale)", fontsize=9)
    ax.set_ylabel("fraction of problems", fontsize=9)
    ax.set_ylim(-0.03, 1.03)
    ax.grid(True, alpha=0.35)
    ax.tick_params(labelsize=8)
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5), frameon=False)
    return data_uri(fig)


# (row field, legend, colour, line style, marker); compute-optimal wide and pale underneath, so
# a baseline that ties it stays visible on top
SELECTION_LINES = (("accuracy", "compute-optimal", "#111111", "-", "o"), ("majority_vote", "majority vote", "#1f77b4", "--", "s"),
                   ("best_of_n", "best-of-N", "#ff7f0e", "--", "^"), ("best_single", "best single strategy", "#7f7f7f", ":", "v"))


def selection_figure(rows: Sequence[Mapping[str, Any]]) -> str | None:
    """Held-out accuracy of the compute-optimal choice per FLOPs budget against majority vote,
    best-of-N and the best single strategy at the same budget; None without rows that have a
    positive budget."""
    rows = sorted((r for r in rows if _positive(r.get("budget_flops"))), key=lambda r: float(r["budget_flops"]))
    if not rows:
        return None
    fig = Figure(figsize=(7.5, 3.4))
    ax = fig.subplots()
    for key, label, color, style, marker in SELECTION_LINES:
        pts = [(float(r["budget_flops"]), float(r[key])) for r in rows if _number(r.get(key))]
        if not pts:
            continue
        wide = key == "accuracy"
        ax.plot([x for x, _ in pts], [y for _, y in pts], style, marker=marker, markersize=9 if wide else 5, color=color,
                label=label, linewidth=5 if wide else 1.5, alpha=0.3 if wide else 1.0, zorder=2 if wide else 3)
    _style_axes(ax, "FLOPs budget per problem (FLOPs)", "held-out accuracy (fraction correct)", "flops")
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5), frameon=False)
    return data_uri(fig)


def vote_summary_figure(rows: Sequence[tuple[str, Mapping[str, int]]]) -> str | None:
    """One horizontal bar per voting strategy, split by what happened on each problem (the
    `VOTE_OUTCOMES`): how often the most-voted answer was right, how often a right answer got
    votes but lost, how often no vote was right. ``rows``: (strategy, outcome -> problems)."""
    rows = [(name, counts) for name, counts in rows if sum(counts.values())]
    if not rows:
        return None
    height = 0.9 + 0.34 * len(rows)
    fig = Figure(figsize=(10, height))
    ax = fig.subplots()
    names = [name for name, _ in rows][::-1]
    lefts = [0] * len(rows)
    for outcome, color in VOTE_OUTCOMES:
        widths = [counts.get(outcome, 0) for _, counts in rows][::-1]
        ax.barh(names, widths, left=lefts, color=color, label=outcome, height=0.7)
        for y, (left, width) in enumerate(zip(lefts, widths, strict=True)):
            if width:
                ax.text(left + width / 2, y, str(width), ha="center", va="center", fontsize=7.5, color="white")
        lefts = [a + b for a, b in zip(lefts, widths, strict=True)]
    ax.set_xlabel("problems", fontsize=9)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.tick_params(labelsize=8)
    ax.set_xlim(0, max(lefts))
    ax.legend(fontsize=8, loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=len(VOTE_OUTCOMES), frameon=False)
    return data_uri(fig)

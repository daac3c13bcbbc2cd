"""The report's figures, drawn with matplotlib and returned as ``data:image/png;base64,...``
URIs, so the HTML file carries them inside itself (no file beside it, nothing fetched).

Each figure is drawn on its own `matplotlib.figure.Figure` with the Agg canvas, never through
pyplot: no global backend is switched, no window opens, and nothing is left in pyplot's list
of open figures when a long-lived process (a notebook, the server) builds a report.

Inputs are the analysis dict's parts (``curves``, ``frontier``, ``selection``) or small
tables `views` prepares; every function returns None when it has nothing to draw, so the
page can say so instead of showing an empty frame. Where things go (family styles, y limits,
curves that coincide, labels that must not overlap) is worked out in `figure_layout`.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Mapping, Sequence
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import EngFormatter, FuncFormatter, LogLocator, MaxNLocator, NullFormatter
from matplotlib.transforms import offset_copy

from metaloom.eval.report.figure_layout import (
    DEFAULT_STYLE,
    OVERLAP_TOLERANCE,
    Style,
    coincident,
    cost_axes,
    fitted_ylim,
    interval,
    offsets,
    placeable,
    placed_xy,
    points_ylim,
    short_names,
    spread,
    wrap_label,
)
from metaloom.present.numbers import finite, fmt_bytes

ACCURACY_LABEL = "accuracy (fraction correct)"
DPI = 120  # 1 inch of figure = 120 px: sharp at the page's 1200 px width without a heavy file
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


def _draw_family(ax: Any, points: Sequence[Mapping[str, Any]], x_key: str, y_key: str, style: Style, label: str,
                 dashed: bool = False, hollow: bool = False, offset: float = 0.0, line: str | None = None,
                 band: bool = True) -> int:
    """One family's points on ``ax`` in its ``style``: a line with its 95% band where there are
    two or more, a marker with an error bar for a single point; ``dashed``: a second series of
    the family (its accuracy beside its coverage), paler band; ``hollow``: open markers (points
    measured on other problems); ``offset``: points up or down (a copy of a coinciding curve);
    ``line``: a line style other than the family's; ``band``: False where a coinciding curve
    already drew it. Returns how many points had no place (no positive x, no y)."""
    placed = sorted(((float(p[x_key]), p) for p in points if placeable(p.get(x_key)) and finite(p.get(y_key))),
                    key=lambda xp: xp[0])
    if not placed:
        return len(points)
    xs = [x for x, _ in placed]
    ys = [float(p[y_key]) for _, p in placed]
    bands = [interval(p, y_key) for _, p in placed]
    line = line or style.linestyle
    shift = offset_copy(ax.transData, fig=ax.figure, y=offset, units="points") if offset else ax.transData
    ax.update_datalim(list(zip(xs, ys, strict=True)))  # a line in an offset transform does not widen the axes itself
    face = "white" if hollow else style.color
    if len(placed) > 1:
        ax.plot(xs, ys, linestyle=line, color=style.color, marker=style.marker, markersize=4.5, linewidth=1.6,
                markerfacecolor=face, label=label, transform=shift, zorder=3)
        if band:
            ax.fill_between(xs, [b[0] for b in bands], [b[1] for b in bands], color=style.color,
                            alpha=0.15 if not dashed else 0.07, linewidth=0)
    else:
        ax.errorbar(xs, ys, yerr=[[ys[0] - bands[0][0]], [bands[0][1] - ys[0]]], fmt=style.marker, color=style.color,
                    markersize=6.5, capsize=3, markerfacecolor=face, label=label, transform=shift, zorder=3)
    return len(points) - len(placed)


def _label_overlaps(ax: Any, groups: Sequence[Sequence[str]], series: Mapping[str, Sequence[tuple[float, float]]],
                    names: Mapping[str, str]) -> int:
    """A label at the right end of each group of coinciding curves naming every member (the
    legend alone cannot say that a line hides another), stacked so labels do not overlap.
    Call after the limits are set (it places labels in points). Returns the labels drawn."""
    if not groups:
        return 0
    ends = [series[g[0]][-1] for g in groups]
    to_points = 72 / ax.figure.dpi
    heights = [float(ax.transData.transform(end)[1]) * to_points for end in ends]
    texts = [wrap_label("same curve: " + ", ".join(names.get(n, n) for n in g), 44) for g in groups]
    sizes = [7.5 * (t.count("\n") + 1) + 3 for t in texts]
    bottoms = spread([h + 6 for h in heights], sizes)
    for text, end, h, bottom in zip(texts, ends, heights, bottoms, strict=True):
        ax.annotate(text, xy=end, xytext=(-4, bottom - h), textcoords="offset points", ha="right", va="bottom",
                    fontsize=6.5, color="#333333", zorder=6, annotation_clip=False,
                    bbox={"boxstyle": "round,pad=0.15", "facecolor": "white", "edgecolor": "#999999", "alpha": 0.65,
                          "linewidth": 0.5},
                    arrowprops={"arrowstyle": "-", "color": "#999999", "linewidth": 0.6})
    return len(groups)


def _draw_frontier(ax: Any, labels: Sequence[str], by_label: Mapping[str, Mapping[str, Any]], x_key: str) -> bool:
    """The Pareto frontier on ``ax``: ringed points joined by a dashed black step line."""
    placed = [(float(by_label[lab][x_key]), float(by_label[lab]["accuracy"])) for lab in labels
              if lab in by_label and placeable(by_label[lab].get(x_key)) and finite(by_label[lab].get("accuracy"))]
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


def _bytes(v: float, _pos: Any = None) -> str:
    return fmt_bytes(v).replace(" ", "")


# tick labels per cost: FLOPs and tokens in engineering units (4G, 20k), seconds as numbers,
# memory in binary units (64KiB)
TICK_FORMATS: dict[str, Any] = {"flops": lambda: EngFormatter(sep=""), "output_tokens": lambda: EngFormatter(sep=""),
                                "seconds": lambda: FuncFormatter(_plain), "k": lambda: FuncFormatter(_plain),
                                "kv_bytes_peak": lambda: FuncFormatter(_bytes)}


def _log_ticks(ax: Any, key: str) -> None:
    """Labels at 1, 2 and 5 times each power of ten only: matplotlib's default labels every
    minor tick on a short log axis, and they run into each other."""
    ax.xaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.xaxis.set_major_formatter(TICK_FORMATS.get(key, lambda: FuncFormatter(_plain))())
    ax.xaxis.set_minor_formatter(NullFormatter())


def _style_axes(ax: Any, xlabel: str, ylabel: str | None, key: str = "",
                ylim: tuple[float, float] = (-0.03, 1.03)) -> None:
    ax.set_xscale("log")
    _log_ticks(ax, key)
    ax.set_xlabel(xlabel, fontsize=9)
    if ylabel:
        ax.set_ylabel(ylabel, fontsize=9)
    ax.set_ylim(*ylim)
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


def accuracy_figure(curves: Sequence[Mapping[str, Any]], frontier: Mapping[str, Sequence[str]],
                    styles: Mapping[str, Style], outside: Sequence[Mapping[str, Any]] = ()) -> tuple[str, int] | None:
    """`draw_accuracy` as a data URI, with its count of points left out."""
    drawn = draw_accuracy(curves, frontier, styles, outside)
    return None if drawn is None else (data_uri(drawn[0]), drawn[1])


def draw_accuracy(curves: Sequence[Mapping[str, Any]], frontier: Mapping[str, Sequence[str]],
                  styles: Mapping[str, Style], outside: Sequence[Mapping[str, Any]] = ()) -> tuple[Figure, int] | None:
    """Accuracy against each cost (output tokens, FLOPs, seconds; peak KV memory where measured,
    `cost_axes`; log x), one line per family
    in its style with its 95% band, the Pareto frontier of that cost ringed; y fitted to the
    points and their intervals; curves that coincide drawn a little apart and labelled.
    ``curves``: the points compared on one problem set; ``outside``: families' points measured
    on other problems, drawn hollow and named as such (they are on no frontier). Returns the
    figure and how many (point, cost) pairs were left out for having no positive cost; None
    without points."""
    points = [p for c in curves for p in c.get("points") or ()]
    apart = [p for c in outside for p in c.get("points") or ()]
    if not points and not apart:
        return None
    by_label = {p["label"]: p for p in points if "label" in p}
    ylim = points_ylim([*points, *apart], ("accuracy",))
    costs = cost_axes([*points, *apart])
    fig = Figure(figsize=(4.3 * len(costs), 4.3))
    axes = fig.subplots(1, len(costs), sharey=True)
    missing = 0
    for k, (ax, (key, xlabel)) in enumerate(zip(axes, costs, strict=True)):
        series = {c["family"]: placed_xy(c.get("points") or (), key, "accuracy") for c in curves}
        groups = coincident(series, OVERLAP_TOLERANCE * (ylim[1] - ylim[0]))
        shift = offsets(groups)
        drawn = False
        followers = {n for g in groups for n in g[1:]}
        for curve in curves:
            pts = curve.get("points") or []
            fam = curve["family"]
            left = _draw_family(ax, pts, key, "accuracy", styles.get(fam, DEFAULT_STYLE), fam, offset=shift.get(fam, 0.0),
                                band=fam not in followers)
            missing += left
            drawn = drawn or left < len(pts)
        for curve in outside:
            pts = curve.get("points") or []
            counts = sorted({int(p["problems"]) for p in pts if finite(p.get("problems"))})
            label = f"{curve['family']} (on {'/'.join(map(str, counts)) or '?'} problems: not compared)"
            left = _draw_family(ax, pts, key, "accuracy", styles.get(curve["family"], DEFAULT_STYLE), label, hollow=True)
            missing += left
            drawn = drawn or left < len(pts)
        _draw_frontier(ax, frontier.get(key) or (), by_label, key)
        if drawn:
            _style_axes(ax, xlabel, ACCURACY_LABEL if k == 0 else None, key, ylim)
            _label_overlaps(ax, groups, series, short_names(list(series)))
        else:
            ax.set_xlabel(xlabel, fontsize=9)
            ax.text(0.5, 0.5, "no positive cost measured", ha="center", va="center", transform=ax.transAxes,
                    fontsize=9, color="#666666")
            ax.set_xticks([])
            if k == 0:
                ax.set_ylabel(ACCURACY_LABEL, fontsize=9)
    fig.subplots_adjust(wspace=0.08, bottom=0.2)
    _legend_below(fig, axes)
    return fig, missing


def coverage_figure(curves: Sequence[Mapping[str, Any]], styles: Mapping[str, Style]) -> str | None:
    """`draw_coverage` as a data URI."""
    fig = draw_coverage(curves, styles)
    return None if fig is None else data_uri(fig)


def draw_coverage(curves: Sequence[Mapping[str, Any]], styles: Mapping[str, Style]) -> Figure | None:
    """Coverage (pass@k: some sample is correct) against samples k, solid with its band, and
    the family's accuracy at the same k dotted: the gap between them is what the selection
    (the vote, the scorer) loses. Families reading one pool have one coverage curve: it is
    drawn once per family, a little apart, and labelled with every family it belongs to.
    Families without k or coverage are left out; None when none has them."""
    fig = Figure(figsize=(7.5, 3.6))
    ax = fig.subplots()
    kept = []
    for curve in curves:
        pts = [p for p in curve.get("points") or () if placeable(p.get("k")) and finite(p.get("coverage"))]
        if pts:
            kept.append((curve["family"], pts))
    if not kept:
        return None
    ylim = points_ylim([p for _, pts in kept for p in pts], ("coverage", "accuracy"))
    series: dict[str, list[tuple[float, float]]] = {}
    for fam, pts in kept:
        series[f"{fam} coverage"] = placed_xy(pts, "k", "coverage")
        series[f"{fam} accuracy"] = placed_xy(pts, "k", "accuracy")
    groups = coincident(series, OVERLAP_TOLERANCE * (ylim[1] - ylim[0]))
    shift = offsets(groups)
    followers = {n for g in groups for n in g[1:]}
    for fam, pts in kept:
        style = styles.get(fam, DEFAULT_STYLE)
        for key, name, dashed in (("coverage", f"{fam} coverage", False), ("accuracy", f"{fam} accuracy", True)):
            _draw_family(ax, pts, "k", key, style, name, dashed=dashed, offset=shift.get(name, 0.0),
                         line=":" if dashed else "-", band=name not in followers)
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(FuncFormatter(_plain))
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("samples per problem k (log₂ scale)", fontsize=9)
    ax.set_ylabel("fraction of problems", fontsize=9)
    ax.set_ylim(*ylim)
    ax.grid(True, alpha=0.35)
    ax.tick_params(labelsize=8)
    short = short_names([fam for fam, _ in kept])
    _label_overlaps(ax, groups, series, {f"{fam} {key}": f"{short[fam]} {key}" for fam, _ in kept
                                         for key in ("coverage", "accuracy")})
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5), frameon=False)
    return fig


# (row field, legend, colour, line style, marker); compute-optimal wide and pale underneath, so
# a baseline that ties it stays visible on top
SELECTION_LINES = (("accuracy", "compute-optimal", "#111111", "-", "o"), ("majority_vote", "majority vote", "#1f77b4", "--", "s"),
                   ("best_of_n", "best-of-N", "#ff7f0e", "--", "^"), ("best_single", "best single strategy", "#7f7f7f", ":", "v"))


def selection_figure(rows: Sequence[Mapping[str, Any]]) -> str | None:
    """Held-out accuracy of the compute-optimal choice per FLOPs budget against majority vote,
    best-of-N and the best single strategy at the same budget; None without rows that have a
    positive budget."""
    rows = sorted((r for r in rows if placeable(r.get("budget_flops"))), key=lambda r: float(r["budget_flops"]))
    if not rows:
        return None
    fig = Figure(figsize=(7.5, 3.4))
    ax = fig.subplots()
    series = {label: [(float(r["budget_flops"]), float(r[key])) for r in rows if finite(r.get(key))]
              for key, label, *_ in SELECTION_LINES}
    values = [y for pts in series.values() for _, y in pts]
    ylim = fitted_ylim(values, values)
    # compute-optimal is drawn wide underneath: only the baselines that coincide are set apart
    groups = coincident({k: v for k, v in series.items() if k != SELECTION_LINES[0][1]},
                        OVERLAP_TOLERANCE * (ylim[1] - ylim[0]))
    shift = offsets(groups)
    for key, label, color, style, marker in SELECTION_LINES:
        pts = series[label]
        if not pts:
            continue
        wide = key == "accuracy"
        moved = offset_copy(ax.transData, fig=fig, y=shift[label], units="points") if label in shift else ax.transData
        ax.update_datalim(pts)  # a line drawn in an offset transform does not widen the axes itself
        ax.plot([x for x, _ in pts], [y for _, y in pts], style, marker=marker, markersize=9 if wide else 5, color=color,
                label=label, linewidth=5 if wide else 1.5, alpha=0.3 if wide else 1.0, zorder=2 if wide else 3,
                transform=moved)
    _style_axes(ax, "FLOPs budget per problem (FLOPs)", "held-out accuracy (fraction correct)", "flops", ylim)
    _label_overlaps(ax, groups, series, {})
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

"""Where and how things go on the report's figures, as plain arithmetic (no matplotlib, so the
tests pin it on hand-made numbers): one style per strategy family, legend labels that stay
short and wrap, y limits fitted to the values and their intervals, and curves that would be
drawn on top of each other found, set a little apart, and their labels stacked so they do not
overlap. `figures` draws with these.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from metaloom.present.numbers import finite

# (point field, axis label with its unit) for the costs a curve is drawn against
# (`metaloom.eval.analysis.subsample.COSTS`)
COST_AXES = (
    ("output_tokens", "mean output tokens per problem (tokens)"),
    ("flops", "mean compute per problem (FLOPs)"),
    ("seconds", "mean wall time per problem (s)"),
    ("kv_bytes_peak", "mean peak KV memory per problem (bytes)"),
)
# costs drawn only where some point has them: a sweep written before peaks were measured, or
# run against a server that reports none, keeps its three panels instead of an empty fourth
MEASURED_ONLY = frozenset({"kv_bytes_peak"})


def cost_axes(points: Sequence[Mapping[str, Any]]) -> list[tuple[str, str]]:
    """The `COST_AXES` to draw for ``points``: all but a `MEASURED_ONLY` cost no point has."""
    return [(key, label) for key, label in COST_AXES
            if key not in MEASURED_ONLY or any(finite(p.get(key)) for p in points)]


PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
           "#bcbd22", "#17becf")
# cycle lengths 10, 7 and 3 are coprime: (colour, marker, line) repeats only after 210 families,
# and any two of the first 70 differ in colour and marker at once
MARKERS = ("o", "s", "^", "D", "v", "P", "X")
LINESTYLES = ("-", "--", "-.")
OVERLAP_OFFSET = 2.5  # points between the drawn copies of curves that coincide
OVERLAP_TOLERANCE = 0.012  # curves closer than this share of the y axis, at every x, coincide


@dataclass(frozen=True)
class Style:
    """How one family is drawn: its colour, marker and line style."""

    color: str
    marker: str
    linestyle: str


def family_styles(families: Sequence[str]) -> dict[str, Style]:
    """One style per family, fixed by its place in ``families`` (every family of the report,
    so the same family looks the same in every figure): colour, marker and line style cycle
    with coprime lengths, so no two of the first 70 families share a colour or a marker with
    the same other (greedy and DVTS were both blue squares)."""
    return {f: Style(PALETTE[k % len(PALETTE)], MARKERS[k % len(MARKERS)], LINESTYLES[k % len(LINESTYLES)])
            for k, f in enumerate(dict.fromkeys(families))}


DEFAULT_STYLE = Style(PALETTE[0], MARKERS[0], LINESTYLES[0])


def short_names(families: Sequence[str]) -> dict[str, str]:
    """Each family by its strategy's name alone (``mbr``) where no other family has that
    name, else in full (``best_of_n@scorer=logprob`` beside ``best_of_n@scorer=judge``)."""
    heads = [f.split("@", 1)[0] for f in families]
    return {f: h if heads.count(h) == 1 else f for f, h in zip(families, heads, strict=True)}


def wrap_label(label: str, width: int = 40) -> str:
    """``label`` on lines of at most about ``width`` characters, broken after commas."""
    lines: list[str] = []
    for part in label.replace(",", ",\0").split("\0"):
        if lines and len(lines[-1]) + len(part) <= width:
            lines[-1] += part
        else:
            lines.append(part.lstrip() if lines else part)  # a new line does not start with the comma's space
    return "\n".join(lines)


def fitted_ylim(lows: Sequence[float], highs: Sequence[float], *, margin: float = 0.06,
                least_span: float = 0.1) -> tuple[float, float]:
    """Y limits around the values and their intervals (``lows``, ``highs``): their range plus
    ``margin`` of it each side, at least ``least_span`` wide, within -0.02..1.02 (fractions).
    A fixed 0..1 squashed curves that never pass 0.32 into the bottom third."""
    known = [float(v) for v in (*lows, *highs) if finite(v)]
    if not known:
        return -0.03, 1.03
    lo, hi = min(known), max(known)
    if hi - lo < least_span:
        middle = (lo + hi) / 2
        lo, hi = middle - least_span / 2, middle + least_span / 2
        if lo < 0:
            lo, hi = 0.0, least_span
        if hi > 1:
            lo, hi = 1 - least_span, 1.0
    pad = margin * (hi - lo)
    return max(-0.02, lo - pad), min(1.02, hi + pad)


def coincident(series: Mapping[str, Sequence[tuple[float, float]]], ytol: float,
               xtol: float = 0.01) -> list[list[str]]:
    """Groups (two or more, in ``series`` order) of series that would be drawn on top of each
    other: the same number of points, each at the same x (relative ``xtol``) and within
    ``ytol`` in y. ``series``: name -> (x, y) points in x order."""
    def same(a: Sequence[tuple[float, float]], b: Sequence[tuple[float, float]]) -> bool:
        return len(a) == len(b) and all(abs(xa - xb) <= xtol * max(abs(xa), abs(xb)) and abs(ya - yb) <= ytol
                                        for (xa, ya), (xb, yb) in zip(a, b, strict=True))

    groups: list[list[str]] = []
    for name, pts in series.items():
        if not pts:
            continue
        home = next((g for g in groups if same(series[g[0]], pts)), None)
        if home is None:
            groups.append([name])
        else:
            home.append(name)
    return [g for g in groups if len(g) > 1]


def offsets(groups: Sequence[Sequence[str]], step: float = OVERLAP_OFFSET) -> dict[str, float]:
    """The vertical offset (points) of each member of each coinciding group: spread evenly
    around the curve, so each copy shows beside the others."""
    return {name: (j - (len(g) - 1) / 2) * step for g in groups for j, name in enumerate(g)}


def spread(positions: Sequence[float], sizes: Sequence[float], pad: float = 2.0) -> list[float]:
    """Label bottoms (points) moved up as little as needed so that labels of ``sizes`` (their
    heights) stacked from the lowest do not overlap: each starts ``pad`` above the one below."""
    out = list(positions)
    top = -math.inf
    for i in sorted(range(len(positions)), key=lambda i: positions[i]):
        out[i] = max(positions[i], top + pad)
        top = out[i] + sizes[i]
    return out


def placeable(v: Any) -> bool:
    """A cost a log axis can place: a finite number above zero (0 or null cost, e.g. a scripted
    generator that counts no FLOPs, has no place on it)."""
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) and v > 0


def interval(point: Mapping[str, Any], key: str) -> tuple[float, float]:
    """The point's 95% interval for ``key`` (accuracy or coverage); the value itself where the
    analysis gave none."""
    value = float(point[key])
    lo: Any = point.get(f"{key}_lo")
    hi: Any = point.get(f"{key}_hi")
    return (float(lo) if finite(lo) else value, float(hi) if finite(hi) else value)


def placed_xy(points: Sequence[Mapping[str, Any]], x_key: str, y_key: str) -> list[tuple[float, float]]:
    """The (x, y) of the points a log axis can place, in x order."""
    return sorted((float(p[x_key]), float(p[y_key])) for p in points if placeable(p.get(x_key)) and finite(p.get(y_key)))


def points_ylim(points: Sequence[Mapping[str, Any]], keys: Sequence[str]) -> tuple[float, float]:
    """`fitted_ylim` over the points' values of ``keys`` and their intervals."""
    bands = [interval(p, k) for p in points for k in keys if finite(p.get(k))]
    return fitted_ylim([lo for lo, _ in bands], [hi for _, hi in bands])

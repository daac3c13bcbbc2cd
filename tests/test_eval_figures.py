"""The report's figures (issue 30): a distinct style per family, y axes fitted to the data and
its intervals, curves that coincide drawn apart and labelled. On hand-made curves."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from metaloom.eval.report.figure_layout import (
    coincident,
    family_styles,
    fitted_ylim,
    offsets,
    short_names,
    spread,
)
from metaloom.eval.report.figures import draw_accuracy, draw_coverage, selection_figure

GSM_FAMILIES = ["majority_vote", "best_of_n@scorer=logprob", "mbr", "weighted_vote@scorer=logprob,transform=exp",
                "best_of_n@scorer=judge", "greedy", "adaptive_vote@max_samples=16,batch=8",
                "step_beam_search@beam_width=4,step_scorer=judge", "particle_filtering@step_scorer=judge", "rebase",
                "dvts@beam_width=4", "lookahead@beam_width=4", "mcts@iterations=8", "a_star@k=4", "best_first@k=4",
                "step_beam_search@step_scorer=rollout", "particle_filtering@step_scorer=rollout",
                "particle_filtering@budget"]


def point(label: str, k: int | None, acc: float, cost: float, lo: float | None = None, hi: float | None = None,
          coverage: float | None = None) -> dict[str, Any]:
    return {"label": label, "k": k, "accuracy": acc, "accuracy_lo": acc - 0.04 if lo is None else lo,
            "accuracy_hi": acc + 0.04 if hi is None else hi, "coverage": coverage,
            "coverage_lo": None if coverage is None else coverage - 0.05,
            "coverage_hi": None if coverage is None else coverage + 0.05,
            "output_tokens": cost, "flops": cost * 1e9, "seconds": cost / 100, "problems": 40}


def curve(family: str, accs: list[float], coverages: list[float] | None = None) -> dict[str, Any]:
    ks = [2 ** i for i in range(len(accs))]
    return {"family": family, "points": [point(f"{family}@n={k}", k, a, 100.0 * k, coverage=None if coverages is None
                                               else coverages[i]) for i, (k, a) in enumerate(zip(ks, accs, strict=True))]}


def test_every_family_in_a_figure_has_its_own_style_the_same_in_every_figure():
    styles = family_styles(GSM_FAMILIES)
    assert len(set(styles.values())) == len(GSM_FAMILIES)
    # not only the triple: colour and marker together differ (greedy and dvts were both blue squares)
    assert len({(s.color, s.marker) for s in styles.values()}) == len(GSM_FAMILIES)
    many = family_styles([f"f{i}" for i in range(70)])
    assert len({(s.color, s.marker) for s in many.values()}) == 70
    assert family_styles(GSM_FAMILIES) == styles  # stable: every figure of a report asks with the same list
    assert family_styles([*GSM_FAMILIES, "greedy"]) == styles  # a repeat does not shift the others


def test_y_limits_fit_the_data_and_its_intervals():
    lo, hi = fitted_ylim([0.0, 0.05, 0.1], [0.2, 0.28, 0.32])
    assert lo < 0.0 + 1e-9 and 0.32 < hi < 0.4  # curves under 0.32: the top well below 1
    assert fitted_ylim([0.0], [0.0]) == pytest.approx((-0.006, 0.106))  # all zero: a readable band, not a line
    assert fitted_ylim([0.95], [1.0])[1] <= 1.02
    assert fitted_ylim([0.0], [1.0]) == (-0.02, 1.02)
    assert fitted_ylim([], []) == (-0.03, 1.03)
    # the figure uses them: hand-made curves under 0.32 with intervals to 0.36
    fig, missing = draw_accuracy([curve("majority_vote", [0.1, 0.2, 0.3], None), curve("mbr", [0.05, 0.1, 0.12])],
                                 {}, family_styles(["majority_vote", "mbr"]))
    assert missing == 0
    bottom, top = fig.axes[0].get_ylim()
    assert 0.34 <= top < 0.45 and bottom <= 0.01


def test_coincident_curves_are_grouped_with_tolerance():
    a = [(1.0, 0.1), (2.0, 0.2), (4.0, 0.3)]
    series = {"a": a, "b": [(1.0, 0.1005), (2.0, 0.2), (4.0, 0.2995)], "c": [(1.0, 0.1), (2.0, 0.25), (4.0, 0.3)],
              "d": a[:2], "e": list(a), "f": []}
    assert coincident(series, ytol=0.002) == [["a", "b", "e"]]
    assert coincident(series, ytol=0.06) == [["a", "b", "c", "e"]]
    assert offsets([["a", "b", "e"]], 2.0) == {"a": -2.0, "b": 0.0, "e": 2.0}
    assert spread([10.0, 11.0, 40.0], [8.0, 8.0, 8.0], pad=2.0) == [10.0, 20.0, 40.0]
    assert spread([30.0, 10.0], [25.0, 5.0]) == [30.0, 10.0]
    assert short_names(["best_of_n@scorer=a", "best_of_n@scorer=b", "mbr@x=1"]) == {
        "best_of_n@scorer=a": "best_of_n@scorer=a", "best_of_n@scorer=b": "best_of_n@scorer=b", "mbr@x=1": "mbr"}


def _drawn_heights(ax: Any, label: str) -> np.ndarray:
    """Where a line's points land on the canvas (pixels), its offset included."""
    line = next(ln for ln in ax.get_lines() if ln.get_label() == label)
    return line.get_transform().transform(np.column_stack(line.get_data()))[:, 1]


def test_coinciding_curves_are_drawn_apart_and_labelled():
    # three families reading one pool: the same coverage; two of them the same accuracy too
    cov = [0.1, 0.2, 0.3, 0.4]
    curves = [curve("majority_vote", [0.1, 0.12, 0.15, 0.2], cov), curve("mbr@x=1", [0.1, 0.12, 0.15, 0.2], cov),
              curve("best_of_n", [0.1, 0.08, 0.05, 0.0], cov)]
    styles = family_styles([c["family"] for c in curves])
    fig = draw_coverage(curves, styles)
    assert fig is not None
    ax = fig.axes[0]
    heights = [_drawn_heights(ax, f"{f} coverage") for f in ("majority_vote", "mbr@x=1", "best_of_n")]
    # the same data, three visibly separate lines on the canvas (more than a pixel apart)
    assert np.abs(heights[0] - heights[1]).min() > 2 and np.abs(heights[1] - heights[2]).min() > 2
    labels = [t.get_text().replace("\n", " ") for t in ax.texts]
    assert any("same curve: majority_vote coverage, mbr coverage, best_of_n coverage" in t for t in labels)
    assert any("same curve: majority_vote accuracy, mbr accuracy" in t for t in labels)
    assert not any("best_of_n accuracy" in t for t in labels)  # its own curve: no label
    # the accuracy figure does the same per panel
    fig, _ = draw_accuracy(curves, {}, styles)
    for ax in fig.axes:
        assert [t.get_text() for t in ax.texts] == ["same curve: majority_vote, mbr"]
        assert np.abs(_drawn_heights(ax, "majority_vote") - _drawn_heights(ax, "mbr@x=1")).min() > 2


def test_points_on_other_problems_are_hollow_and_named():
    styles = family_styles(["majority_vote", "particle_filtering@budget"])
    apart = {"family": "particle_filtering@budget", "points": [{**point("particle_filtering@budget", None, 0.32, 5000.0),
                                                                "problems": 22}]}
    fig, _ = draw_accuracy([curve("majority_vote", [0.1, 0.2])], {}, styles, [apart])
    handles, labels = fig.axes[0].get_legend_handles_labels()
    label = "particle_filtering@budget (on 22 problems: not compared)"
    assert label in labels
    marker = handles[labels.index(label)][0]
    assert marker.get_markerfacecolor() == "white"


def test_selection_baselines_that_tie_are_both_visible():
    rows = [{"budget_flops": b, "accuracy": 0.0, "majority_vote": 0.03, "best_of_n": 0.03, "best_single": 0.0}
            for b in (1e12, 2e12, 4e12)]
    assert selection_figure(rows) is not None  # drawn (the labelling itself is tested on the coverage figure)

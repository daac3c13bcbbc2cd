"""Single-run strategies against sampling curves at equal compute (`metaloom.eval.analysis.equal`),
on hand-made points whose interpolations are worked out by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest

from metaloom.eval.analysis.curves import Point
from metaloom.eval.analysis.equal import at_equal_compute, bracket

PROBLEMS = ("a", "b", "c", "d")


def point(label: str, k: int | None, correct: list[float], flops: list[float], problems=PROBLEMS) -> Point:
    fam = "best_of_n@scorer=countdown" if k is not None else label
    arr = np.array(flops, dtype=np.float64)
    return Point(label, label if k is None else "best_of_n@n=4,scorer=countdown", fam, k, tuple(problems),
                 np.array(correct, dtype=np.float64), None if k is None else np.array(correct, dtype=np.float64),
                 {"flops": arr, "output_tokens": arr / 10, "seconds": arr / 100})


# best-of-N at N = 1, 2, 4: mean FLOPs 1, 2, 4 (every problem costs the same)
CURVE = [point("best_of_n@n=1,scorer=countdown", 1, [0.25, 0.0, 0.0, 0.0], [1] * 4),
         point("best_of_n@n=2,scorer=countdown", 2, [0.5, 0.0, 0.5, 0.0], [2] * 4),
         point("best_of_n@n=4,scorer=countdown", 4, [1.0, 0.0, 1.0, 0.0], [4] * 4)]


def test_bracket_interpolates_in_log_cost_and_never_extrapolates():
    assert bracket([1.0, 2.0, 4.0], 2.0) == (1, 1, 0.0)
    i, j, w = bracket([1.0, 2.0, 4.0], math.sqrt(8))  # halfway between 2 and 4 in log
    assert (i, j) == (1, 2) and w == pytest.approx(0.5)
    assert bracket([1.0, 2.0, 4.0], 1.0) == (0, 0, 0.0)
    assert bracket([1.0, 2.0, 4.0], 0.5) is None and bracket([1.0, 2.0, 4.0], 4.5) is None
    assert bracket([1.0, 2.0], 0.0) is None and bracket([], 1.0) is None


def test_a_cost_at_either_end_of_the_curve_is_on_it():
    costs = [1e12, 2e12, 4e12]
    assert bracket(costs, 4e12) == (2, 2, 0.0) and bracket(costs, 1e12) == (0, 0, 0.0)
    # the same FLOPs, its mean summed in another order: an ulp off is the same point, not beyond
    assert bracket(costs, math.nextafter(4e12, math.inf)) == (2, 2, 0.0)
    assert bracket(costs, math.nextafter(1e12, 0.0)) == (0, 0, 0.0)
    assert bracket(costs, 4e12 * 1.001) is None  # a real step past it still is


def test_a_search_is_read_against_the_curve_at_its_own_cost():
    search = point("step_beam_search@n=8", None, [1.0, 1.0, 0.0, 0.0], [2 ** 1.25] * 4)
    [row] = at_equal_compute([*CURVE, search], bootstrap=200)
    # best-of-N at 2^1.25 FLOPs: a quarter of the way (in log) from N=2 (0.25) to N=4 (0.5)
    assert row["family_accuracy"] == pytest.approx(0.3125)
    assert row["accuracy"] == 0.5 and row["difference"] == pytest.approx(0.1875)
    assert row["between"] == ["best_of_n@n=2,scorer=countdown", "best_of_n@n=4,scorer=countdown"]
    # paired per problem: a +0.4375, b +1, c -0.625, d 0; the interval holds the mean
    assert row["difference_lo"] <= 0.1875 <= row["difference_hi"] and row["difference_lo"] >= -0.625
    assert row["problems"] == 4 and row["reason"] is None


def test_outside_the_curve_there_is_no_answer_and_the_reason_says_which_side():
    cheap = point("greedy", None, [0, 0, 0, 0], [0.5] * 4)
    dear = point("mcts", None, [1, 1, 1, 1], [8.0] * 4)
    rows = {r["strategy"]: r for r in at_equal_compute([*CURVE, cheap, dear], bootstrap=50)}
    assert rows["greedy"]["family_accuracy"] is None and "below" in rows["greedy"]["reason"]
    assert rows["mcts"]["difference"] is None and "beyond" in rows["mcts"]["reason"]
    assert rows["mcts"]["accuracy"] == 1.0 and rows["mcts"]["cost"] == 8.0


def test_only_the_shared_problems_count():
    search = point("rebase@n=8", None, [1.0, 0.0], [2.0, 2.0], problems=("c", "d"))
    [row] = at_equal_compute([*CURVE, search], bootstrap=50)
    # on c and d best-of-N at N=2 scores (0.5 + 0) / 2
    assert row["problems"] == 2 and row["family_accuracy"] == pytest.approx(0.25)
    assert row["difference"] == pytest.approx(0.25)


def test_unknown_costs_are_said_not_guessed():
    search = point("dvts@n=8", None, [1, 0, 0, 0], [math.nan] * 4)
    [row] = at_equal_compute([*CURVE, search], bootstrap=50)
    assert row["family_accuracy"] is None and row["reason"] == "flops unknown"


def test_a_cost_a_log_axis_cannot_place_is_said():
    free = point("greedy", None, [1, 0, 0, 0], [0.0] * 4)
    [row] = at_equal_compute([*CURVE, free], bootstrap=50)
    assert row["difference"] is None and row["reason"] == "no positive flops to place on a log axis"

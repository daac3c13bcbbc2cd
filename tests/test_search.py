"""Tree search over reasoning steps (`metaloom.search`): golden trees with a scripted generator
and scripted step scores, each algorithm's expansion order and choice checked against a
hand-worked example; one generator call and one scorer call per round; budgets; bad input."""

from __future__ import annotations

import math
from typing import Any

import pytest

from metaloom.errors import InvalidParameter, ScorerFailed
from metaloom.ledger import Budget, Ledger
from metaloom.sampling.params import SamplingParams
from metaloom.search.a_star import AStar, a_star_cost
from metaloom.search.aggregate import aggregate
from metaloom.search.beam import DVTS, StepBeamSearch
from metaloom.search.best_first import BestFirst
from metaloom.search.lookahead import Lookahead
from metaloom.search.mcts import MCTS, uct
from metaloom.search.particle import ParticleFiltering
from metaloom.search.rebase import Rebase, rebase_widths
from metaloom.testing.scripted import ScriptedGenerator, ScriptedStepScorer
from metaloom.wiring.configure import build_strategy

P = SamplingParams(temperature=0.8, max_tokens=64, seed=1)


class Counting(ScriptedGenerator):
    """Counts generate calls and the requests in each."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.calls: list[int] = []

    def generate(self, requests, *, ledger):  # type: ignore[no-untyped-def]
        self.calls.append(len(requests))
        return super().generate(requests, ledger=ledger)


def tree_of(result) -> dict[str, Any]:  # type: ignore[no-untyped-def]
    trees = [e for e in result.trace if e.kind == "tree"]
    assert len(trees) == 1
    return trees[0].data


def by_text(tree: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {n["text"].strip(): n for n in tree["nodes"] if n["parent"] is not None}


def rounds(tree: dict[str, Any]) -> list[list[str]]:
    """The texts of the nodes expanded in each round ("" for the root)."""
    texts = {n["id"]: n["text"].strip() for n in tree["nodes"]}
    return [[texts[i] for i in r["expanded"]] for r in tree["rounds"]]


# Q: four first steps; b and d lead on. A step without the trailing blank line ends the solution.
BEAM_TABLE = {
    "Q": ["a\n\n", "b\n\n", "c\n\n", "d\n\n"],
    "Qb\n\n": ["b1", "b2\n\n"],
    "Qd\n\n": ["d1", "d2\n\n"],
    "Qb\n\nb2\n\n": ["b2x", "b2y"],
    "Qd\n\nd2\n\n": ["d2x", "d2y"],
}
BEAM_SCORES = {"a": 0.1, "b": 0.9, "c": 0.2, "d": 0.8, "b1": 0.7, "b2": 0.6, "d1": 0.95, "d2": 0.5,
               "b2x": 0.4, "b2y": 0.3, "d2x": 0.35, "d2y": 0.2}


def test_step_beam_search_golden_tree() -> None:
    gen, scorer = Counting(BEAM_TABLE), ScriptedStepScorer(BEAM_SCORES)
    result = StepBeamSearch(step_scorer=scorer, n=4, beam_width=2, params=P).run("Q", gen, ledger=Ledger())
    tree = tree_of(result)
    # keep n / beam_width = 2 of the open steps each round, expand each into 2
    assert rounds(tree) == [[""], ["b", "d"], ["b2", "d2"]]
    nodes = by_text(tree)
    assert nodes["a"]["state"] == "pruned" and nodes["c"]["state"] == "pruned"
    assert nodes["b"]["state"] == "expanded" and nodes["b1"]["state"] == "finished"
    assert nodes["b1"]["finish"] == "eos" and nodes["b"]["finish"] == "step"
    # 6 finished >= n = 4: the search stops; the best finished solution wins
    assert result.best == "d\n\nd1" and tree["best"] == nodes["d1"]["id"] and tree["stop"] == "finished"
    assert sorted(c.text for c in result.candidates) == sorted(
        ["b\n\nb1", "d\n\nd1", "b\n\nb2\n\nb2x", "b\n\nb2\n\nb2y", "d\n\nd2\n\nd2x", "d\n\nd2\n\nd2y"])
    # batched: one generator call and one scorer call per round, the whole frontier in each
    assert gen.calls == [1, 2, 2] and len(scorer.calls) == 3 and len(tree["rounds"]) == 3
    assert result.usage.scorer_calls == 3
    # the scorer saw whole partial solutions, steps with their delimiters
    assert ["b\n\n", "b2\n\n"] in scorer.calls[1]
    # each round's usage adds up to the run's
    assert sum(r["usage"]["output_tokens"] for r in tree["rounds"]) == result.usage.output_tokens


def test_dvts_keeps_subtrees_independent() -> None:
    table = {"Q": ["a\n\n", "b\n\n", "c\n\n", "d\n\n"],
             "Qb\n\n": ["b1", "b2"], "Qc\n\n": ["c1\n\n", "c2"], "Qc\n\nc1\n\n": ["c1x", "c1y"]}
    scores = {"a": 0.1, "b": 0.9, "c": 0.3, "d": 0.2, "b1": 0.8, "b2": 0.85, "c1": 0.7, "c2": 0.1,
              "c1x": 0.6, "c1y": 0.65}
    gen, scorer = Counting(table), ScriptedStepScorer(scores)
    result = DVTS(step_scorer=scorer, n=4, beam_width=2, params=P).run("Q", gen, ledger=Ledger())
    tree = tree_of(result)
    nodes = by_text(tree)
    # subtree 0 = {a, b} keeps b, subtree 1 = {c, d} keeps c: each subtree its own best, where a
    # beam search keeping two would keep b and c too but then share one frontier
    assert rounds(tree) == [[""], ["b", "c"], ["c1"]]
    assert nodes["a"]["subtree"] == 0 and nodes["c"]["subtree"] == 1 and nodes["c1x"]["subtree"] == 1
    assert nodes["d"]["state"] == "pruned" and nodes["c2"]["state"] == "finished"
    # subtree 0 ended at its best b2 (finished); the best finished solution overall is b2
    assert result.best == "b\n\nb2" and gen.calls == [1, 2, 1]


def test_rebase_widths_hand_worked() -> None:
    # softmax([0.9, 0.8, 0.1] / 0.1) = e^0 : e^-1 : e^-8 -> 4 x (0.7309, 0.2689, 0.0002) -> 3, 1, 0
    assert rebase_widths([0.9, 0.8, 0.1], 4, 0.1) == [3, 1, 0]
    assert rebase_widths([0.5, 0.5], 4, 0.1) == [2, 2]
    assert rebase_widths([0.9, 0.1], 4, 100.0) == [2, 2]  # a high temperature spreads the budget
    assert rebase_widths([0.2, 0.1, 0.0], 1, 1.0) == [1, 0, 0]  # nothing rounds up: the best gets one
    assert rebase_widths([0.1, 0.2, 0.0], 1, 1.0) == [0, 1, 0]  # the best, not the first
    assert rebase_widths([0.3], 0, 0.1) == [0]


def test_rebase_golden_tree() -> None:
    table = {"Q": ["a\n\n", "b\n\n", "c\n\n", "d"],
             "Qa\n\n": ["a1", "a2", "a3"], "Qb\n\n": ["b1"]}
    scores = {"a": 0.9, "b": 0.8, "c": 0.1, "d": 0.5, "a1": 0.7, "a2": 0.2, "a3": 0.6, "b1": 0.3}
    gen, scorer = Counting(table), ScriptedStepScorer(scores)
    result = Rebase(step_scorer=scorer, n=4, temperature=0.1, params=P).run("Q", gen, ledger=Ledger())
    tree = tree_of(result)
    nodes = by_text(tree)
    # d finished at depth 1: budget 4 - 1 = 3 over a, b, c with rewards 0.9, 0.8, 0.1 -> 2 / 1 / 0...
    # 3 x (0.7309, 0.2689, 0.0002) = 2.19, 0.81, 0.0007 -> 2, 1, 0
    assert nodes["a"]["width"] == 2 and nodes["b"]["width"] == 1 and nodes["c"]["state"] == "pruned"
    assert rounds(tree) == [[""], ["a", "b"]]
    assert [n["text"] for n in tree["nodes"] if n["parent"] == nodes["a"]["id"]] == ["a1", "a2"]
    assert result.best == "a\n\na1" and tree["stop"] == "finished"


def test_mcts_uct_hand_worked() -> None:
    assert uct(0.8, 1, 2, 1.0) == pytest.approx(0.8 + math.sqrt(math.log(2)))
    assert uct(0.0, 0, 5, 1.0) == math.inf
    table = {"Q": ["a\n\n", "b\n\n"], "Qb\n\n": ["b1", "b2\n\n"]}
    scores = {"a": 0.3, "b": 0.8, "b1": 0.9, "b2": 0.2}
    gen, scorer = Counting(table), ScriptedStepScorer(scores)
    result = MCTS(step_scorer=scorer, iterations=2, k=2, parallel=1, c=1.0, params=P).run("Q", gen, ledger=Ledger())
    tree = tree_of(result)
    nodes = by_text(tree)
    # iteration 1 expands the root; iteration 2: UCT(a) = 0.3 + sqrt(ln 2) < UCT(b) = 0.8 + sqrt(ln 2)
    assert rounds(tree) == [[""], ["b"]]
    assert nodes["b"]["visits"] == 3 and nodes["b"]["value"] == pytest.approx(0.8 + 0.9 + 0.2)
    root = tree["nodes"][0]
    assert root["visits"] == 4 and root["value"] == pytest.approx(0.3 + 0.8 + 0.9 + 0.2)
    assert result.best == "b\n\nb1" and tree["stop"] == "iterations"


def test_mcts_parallel_selection_uses_virtual_loss() -> None:
    table = {"Q": ["a\n\n", "b\n\n"], "Qa\n\n": ["a1", "a2"], "Qb\n\n": ["b1", "b2"]}
    scores = {"a": 0.3, "b": 0.8, "a1": 0.1, "a2": 0.2, "b1": 0.4, "b2": 0.5}
    gen = Counting(table)
    result = MCTS(step_scorer=ScriptedStepScorer(scores), iterations=2, k=2, parallel=2, params=P).run(
        "Q", gen, ledger=Ledger())
    # round 2 selects b, then (b pending with value 0) a: both leaves in one call
    assert rounds(tree_of(result))[1] == ["b", "a"] and gen.calls == [1, 2]


PRIORITY_TABLE = {"Q": ["a\n\n", "b\n\n"], "Qa\n\n": ["a1", "a2\n\n"], "Qb\n\n": ["b1\n\n", "b2"],
                  "Qb\n\nb1\n\n": ["b1x", "b1y"], "Qa\n\na2\n\n": ["a2x", "a2y"]}
PRIORITY_SCORES = {"a": 0.6, "b": 0.7, "a1": 0.1, "a2": 0.65, "b1": 0.5, "b2": 0.2, "b1x": 0.9, "b1y": 0.3,
                   "a2x": 0.8, "a2y": 0.1}


def test_best_first_expansion_order() -> None:
    gen = Counting(PRIORITY_TABLE)
    result = BestFirst(step_scorer=ScriptedStepScorer(PRIORITY_SCORES), k=2, params=P).run("Q", gen, ledger=Ledger())
    tree = tree_of(result)
    # b (0.7) first; then a2 (0.65) beats a (0.6) and b1 (0.5)... a (0.6) comes before a2 exists
    assert rounds(tree) == [[""], ["b"], ["a"], ["a2"]]
    # the queue then holds a2x (0.8, finished) on top: the first goal popped ends the search
    assert result.best == "a\n\na2\n\na2x" and tree["stop"] == "finished"
    assert by_text(tree)["b1"]["state"] == "pruned"


def test_a_star_cost_and_order() -> None:
    gen = Counting(PRIORITY_TABLE)
    result = AStar(step_scorer=ScriptedStepScorer(PRIORITY_SCORES), k=2, cost_weight=0.0, params=P).run(
        "Q", gen, ledger=Ledger())
    tree = tree_of(result)
    # with no path cost, f = 1 - score: the same order as best-first
    assert rounds(tree) == [[""], ["b"], ["a"], ["a2"]]
    assert by_text(tree)["b"]["priority"] == pytest.approx(0.3)
    # the path cost: mean NLL per token (the scripted generator gives every token log p = -1)
    result = AStar(step_scorer=ScriptedStepScorer(PRIORITY_SCORES), k=2, cost_weight=0.5, params=P).run(
        "Q", Counting(PRIORITY_TABLE), ledger=Ledger())
    assert by_text(tree_of(result))["b"]["priority"] == pytest.approx(0.5 * 1.0 + 0.3)


def test_a_star_cost_function() -> None:
    from metaloom.search.core import Search
    from metaloom.search.tree import Node

    class FakeSearch:
        class tree:
            @staticmethod
            def path(node: Node) -> list[Node]:
                return [Node(1, None, 1, logprobs=(-1.0, -3.0)), node]

    node = Node(2, None, 2, logprobs=(-2.0,), score=0.25)
    search: Search = FakeSearch()  # type: ignore[assignment]
    assert a_star_cost(search, node, 2.0) == pytest.approx(2.0 * 2.0 + 0.75)


def test_lookahead_scores_steps_at_the_end_of_greedy_rollouts() -> None:
    table = {"Q": ["a\n\n", "b\n\n"], "Qa\n\n": ["a-next\n\n"], "Qb\n\n": ["b-next\n\n"]}
    scores = {"a": 0.9, "b": 0.1, "a-next": 0.2, "b-next": 0.7}
    gen, scorer = Counting(table), ScriptedStepScorer(scores, default=0.0)
    result = Lookahead(step_scorer=scorer, n=2, beam_width=2, k=1, max_depth=2, params=P).run(
        "Q", gen, ledger=Ledger())
    tree = tree_of(result)
    nodes = by_text(tree)
    # a looked good alone but its rollout ends at 0.2; b's at 0.7
    assert nodes["a"]["step_score"] == 0.2 and nodes["b"]["step_score"] == 0.7
    assert nodes["b"]["lookahead"] == "b-next\n\n" and nodes["b-next"]["round"] == 1  # a real child only later
    assert rounds(tree)[1] == ["b"]  # b kept (n / beam_width = 1 beam), a pruned
    assert nodes["a"]["state"] == "pruned"
    # round 1: one expansion call + one rollout call, and one scorer call for the lot
    assert gen.calls[:2] == [1, 2] and len(scorer.calls) >= 1 and len(scorer.calls[0]) == 2


def test_a_budget_stop_before_scoring_says_unscored_and_the_trace_ends_with_the_tree() -> None:
    """The scorer's budget runs out in round 0: the finished solutions were never scored, so
    their scores are unscored (NaN, null in JSON), not 0.0; the trace's last event is the tree
    (the budget event, and the interrupted round's, before it: it used to end `tree, budget`)."""
    import json
    import math

    result = StepBeamSearch(step_scorer=ScriptedStepScorer(BEAM_SCORES), n=4, beam_width=2, params=P).run(
        "Q", Counting(BEAM_TABLE), ledger=Ledger(budget=Budget(scorer_calls=1)))
    assert result.stopped_reason == "budget" and result.candidates
    assert all(math.isnan(s) for s in result.scores)
    assert json.loads(json.dumps(result.to_dict()))["scores"] == [None] * len(result.candidates)
    kinds = [e.kind for e in result.trace]
    assert kinds[-1] == "tree" and kinds.count("budget") == 1


def test_a_solution_cut_by_the_token_limit_is_not_chosen_over_one_that_ended() -> None:
    """Without a final scorer, a step score says the steps were good, not that the solution
    answered: "b" runs into the solution's token limit with a perfect step score, "a" ends on
    its own with a lower one; "a" is the answer. With an outcome verifier its score decides."""
    from metaloom.sampling.params import SamplingParams
    from metaloom.testing.scripted import ScriptedScorer

    table = {"Q": ["a", "b\n\n"], "Qb\n\n": ["b runs on and on and on and on and on and on"]}
    scores = {"a": 0.6, "b": 0.9}  # the cut step, whatever its text: 1.0 (the default)
    params = SamplingParams(temperature=0.8, max_tokens=6, seed=1)
    result = StepBeamSearch(step_scorer=ScriptedStepScorer(scores, default=1.0), n=2, beam_width=2,
                            params=params).run("Q", Counting(table), ledger=Ledger())
    finishes = {n["text"]: (n["finish"], n["score"]) for n in tree_of(result)["nodes"]}
    assert finishes["a"] == ("eos", 0.6) and finishes["b runs on and"] == ("length", 1.0)
    assert result.best == "a"
    verified = StepBeamSearch(step_scorer=ScriptedStepScorer(scores, default=1.0), n=2, beam_width=2, params=params,
                              final_scorer=ScriptedScorer(fn=lambda t: 0.9 if t.startswith("b") else 0.2)).run(
        "Q", Counting(table), ledger=Ledger())
    assert verified.best == "b\n\nb runs on and"


def test_budget_stop_keeps_the_best_finished_solution() -> None:
    gen = Counting(BEAM_TABLE)
    # round 0 costs 8 output tokens (4 steps of "x" + "\n\n"), round 1 another 8; the first token of
    # round 2 (4 rows) passes 18
    ledger = Ledger(budget=Budget(output_tokens=18))
    result = StepBeamSearch(step_scorer=ScriptedStepScorer(BEAM_SCORES), n=4, beam_width=2, params=P).run(
        "Q", gen, ledger=ledger)
    tree = tree_of(result)
    assert result.stopped_reason == "budget" and tree["stop"] == "budget"
    assert result.best == "d\n\nd1"  # finished in round 1, before the budget ran out in round 2
    assert [e for e in result.trace if e.kind == "budget"]
    assert any(n["finish"] == "budget" for n in tree["nodes"])  # the cut steps are in the tree


def test_budget_before_any_finished_solution_reports_the_best_partial() -> None:
    ledger = Ledger(budget=Budget(output_tokens=9))
    result = StepBeamSearch(step_scorer=ScriptedStepScorer(BEAM_SCORES), n=4, beam_width=2, params=P).run(
        "Q", Counting(BEAM_TABLE), ledger=ledger)
    assert result.stopped_reason == "budget" and result.best == "b\n\n"
    assert result.candidates[0].finish_reason == "budget"


def test_delimiter_that_never_occurs_ends_at_the_token_limit() -> None:
    table = {"Q": ["one two three four five six seven eight nine ten"]}
    gen = ScriptedGenerator(table)
    params = SamplingParams(max_tokens=6, seed=0)
    result = StepBeamSearch(step_scorer=ScriptedStepScorer({}, default=0.5), n=1, beam_width=1, step_tokens=4,
                            delimiter=("###",), params=params).run("Q", gen, ledger=Ledger())
    tree = tree_of(result)
    assert tree["delimiter_seen"] is False
    assert [e for e in result.trace if e.kind == "no_delimiter"]
    assert [n["finish"] for n in tree["nodes"][1:]] == ["step_length", "length"]
    assert result.best == "one two three four five six" and result.candidates[0].finish_reason == "length"


def test_max_depth_ends_solutions() -> None:
    table = {"Q": ["a\n\n"], "Qa\n\n": ["b\n\n"], "Qa\n\nb\n\n": ["c\n\n"]}
    result = StepBeamSearch(step_scorer=ScriptedStepScorer({}, default=0.5), n=1, beam_width=1, max_depth=2,
                            params=P).run("Q", ScriptedGenerator(table), ledger=Ledger())
    assert result.best == "a\n\nb\n\n" and tree_of(result)["nodes"][-1]["finish"] == "max_depth"


def test_a_step_scorer_that_raises_is_a_typed_error_with_the_tree() -> None:
    with pytest.raises(ScorerFailed) as info:
        StepBeamSearch(step_scorer=ScriptedStepScorer({"a": 0.1}), n=4, beam_width=2, params=P).run(
            "Q", Counting(BEAM_TABLE), ledger=Ledger())
    assert info.value.scorer == "scripted_steps" and isinstance(info.value.cause, KeyError)
    partial = info.value.partial
    assert partial is not None and partial.stopped_reason == "scorer_failed"
    assert tree_of(partial)["stop"] == "scorer_failed" and len(tree_of(partial)["nodes"]) == 5


def test_a_step_scorer_answering_the_wrong_shape_fails_cleanly() -> None:
    class Short(ScriptedStepScorer):
        def score_steps(self, prompt, partial_steps, *, ledger, last_only=False):  # type: ignore[no-untyped-def]
            return super().score_steps(prompt, partial_steps, ledger=ledger, last_only=last_only)[:-1]

    with pytest.raises(ScorerFailed, match="step scores for 4"):
        StepBeamSearch(step_scorer=Short(BEAM_SCORES), n=4, beam_width=2, params=P).run(
            "Q", Counting(BEAM_TABLE), ledger=Ledger())


@pytest.mark.parametrize("cls, field", [(StepBeamSearch, "beam_width"), (StepBeamSearch, "n"), (DVTS, "beam_width"),
                                        (Rebase, "n"), (MCTS, "k"), (BestFirst, "k"), (AStar, "parallel"),
                                        (ParticleFiltering, "n")])
def test_zero_widths_are_refused(cls: Any, field: str) -> None:
    with pytest.raises(InvalidParameter, match=field):
        cls(step_scorer=ScriptedStepScorer({}), **{field: 0})


def test_bad_configuration_is_refused() -> None:
    scorer = ScriptedStepScorer({})
    with pytest.raises(InvalidParameter, match="aggregation"):
        StepBeamSearch(step_scorer=scorer, aggregation="median")
    with pytest.raises(InvalidParameter, match="delimiter"):
        StepBeamSearch(step_scorer=scorer, delimiter=("",))
    with pytest.raises(InvalidParameter, match="step_scorer"):
        StepBeamSearch(step_scorer="countdown")  # type: ignore[arg-type]
    with pytest.raises(InvalidParameter, match="select"):
        Rebase(step_scorer=scorer, select="weighted_vote")  # a vote needs an extractor
    with pytest.raises(InvalidParameter, match="temperature"):
        Rebase(step_scorer=scorer, temperature=0.0)
    with pytest.raises(InvalidParameter, match="ess_threshold"):
        ParticleFiltering(step_scorer=scorer, ess_threshold=1.5)


def test_aggregations() -> None:
    assert aggregate("last", [0.2, 0.9]) == 0.9
    assert aggregate("min", [0.2, 0.9]) == 0.2
    assert aggregate("product", [0.5, 0.5]) == 0.25
    assert aggregate("mean", [0.2, 0.6]) == pytest.approx(0.4)
    with pytest.raises(InvalidParameter, match="aggregation"):
        aggregate("max", [0.1])


def test_aggregation_changes_the_choice() -> None:
    table = {"Q": ["a\n\n", "b\n\n"], "Qa\n\n": ["a1"], "Qb\n\n": ["b1"]}
    scores = {"a": 0.1, "b": 0.6, "a1": 0.9, "b1": 0.7}
    last = StepBeamSearch(step_scorer=ScriptedStepScorer(scores), n=2, beam_width=1, params=P)
    assert last.run("Q", ScriptedGenerator(table), ledger=Ledger()).best == "a\n\na1"
    worst = StepBeamSearch(step_scorer=ScriptedStepScorer(scores), n=2, beam_width=1, aggregation="min", params=P)
    assert worst.run("Q", ScriptedGenerator(table), ledger=Ledger()).best == "b\n\nb1"


def test_weighted_vote_selection() -> None:
    from metaloom.score.answers import LastNumber

    table = {"Q": ["x 1", "y 2", "z 2"]}
    scores = {"x 1": 0.9, "y 2": 0.5, "z 2": 0.5}
    config = Rebase(step_scorer=ScriptedStepScorer(scores), n=3, select="weighted_vote", extractor=LastNumber(), params=P)
    result = config.run("Q", ScriptedGenerator(table), ledger=Ledger())
    assert result.answer == "2"  # 0.5 + 0.5 > 0.9
    assert [e for e in result.trace if e.kind == "vote"]


def test_registered_names_build_from_text() -> None:
    for name in ("step_beam_search", "dvts", "lookahead", "rebase", "mcts", "a_star", "particle_filtering", "best_first"):
        strategy = build_strategy(name, {"step_scorer": "countdown"}, {})
        assert type(strategy).__name__ and strategy.step_scorer.name == "countdown"
    with pytest.raises(InvalidParameter, match="step_scorer"):
        build_strategy("dvts", {"step_scorer": "oracle"}, {})
    beam = build_strategy("step_beam_search", {"step_scorer": "countdown", "n": "6", "aggregation": "min"}, {})
    assert beam.n == 6 and beam.aggregation == "min"


@pytest.mark.parametrize("make", [
    lambda s: StepBeamSearch(step_scorer=s, n=4, beam_width=2, params=P),
    lambda s: DVTS(step_scorer=s, n=4, beam_width=2, params=P),
    lambda s: Rebase(step_scorer=s, n=4, params=P),
    lambda s: MCTS(step_scorer=s, iterations=4, k=2, parallel=2, params=P),
    lambda s: AStar(step_scorer=s, k=2, parallel=2, solutions=2, params=P),
    lambda s: BestFirst(step_scorer=s, k=2, parallel=2, solutions=2, params=P),
    lambda s: ParticleFiltering(step_scorer=s, n=4, params=P),
], ids=["step_beam_search", "dvts", "rebase", "mcts", "a_star", "best_first", "particle_filtering"])
def test_one_generator_call_and_one_scorer_call_per_round(make: Any) -> None:
    gen, scorer = Counting(BEAM_TABLE), ScriptedStepScorer(BEAM_SCORES, default=0.0)  # a, c end at once
    result = make(scorer).run("Q", gen, ledger=Ledger())
    tree = tree_of(result)
    assert len(tree["rounds"]) >= 2
    assert len(gen.calls) == len(scorer.calls) == len(tree["rounds"])
    # every request of a round continues one expanded node: as many requests as parents
    assert gen.calls == [len(r["expanded"]) for r in tree["rounds"]]
    assert result.usage.output_tokens == sum(r["usage"]["output_tokens"] for r in tree["rounds"])


def test_a_final_scorer_judges_finished_solutions() -> None:
    from metaloom.testing.scripted import ScriptedScorer

    outcome = ScriptedScorer(fn=lambda text: 1.0 if text.endswith("b2y") else 0.0)
    scorer = ScriptedStepScorer(BEAM_SCORES)
    result = StepBeamSearch(step_scorer=scorer, n=4, beam_width=2, final_scorer=outcome, params=P).run(
        "Q", Counting(BEAM_TABLE), ledger=Ledger())
    tree = tree_of(result)
    nodes = by_text(tree)
    # the step scores would pick d1 (0.95); the outcome verifier finds b2y the one right answer
    assert result.best == "b\n\nb2\n\nb2y" and nodes["b2y"]["final_score"] == 1.0 and nodes["d1"]["score"] == 0.0
    assert nodes["d2"]["score"] == 0.5  # open nodes keep their step scores
    # one step-scorer call per round, one outcome call in each round where solutions finished
    assert len(scorer.calls) == 3 and result.usage.scorer_calls == 3 + 2


def test_rollout_value_exact() -> None:
    """k rollouts from each partial: the fraction a verifier accepts, or the fraction whose answer
    is equivalent to the majority's (5 and 5.0 are one answer to the math extractor)."""
    from metaloom.score.answers import MathAnswer
    from metaloom.score.rollout import RolloutValue
    from metaloom.score.verifier import FunctionVerifier

    table = {"Q": ["a\n\n"], "Qa\n\n": ["so 5", "so 5.0", "so 7", "so 8"], "Qa\n\nb\n\n": ["so 7", "so 7", "so 7", "so 5"]}
    partials = [["a\n\n"], ["a\n\n", "b\n\n"]]
    ledger = Ledger()
    majority = RolloutValue(ScriptedGenerator(table), k=4, extractor=MathAnswer(), max_tokens=8)
    # pooled over the call: 5 (twice, as 5 and 5.0) and 7 (four times) -> 7 is the majority
    assert majority.score_steps("Q", partials, ledger=ledger, last_only=True) == [[0.25], [0.75]]
    assert ledger.usage.scorer_calls == 1 and ledger.usage.output_tokens > 0
    verified = RolloutValue(ScriptedGenerator(table), k=4, verifier=FunctionVerifier(lambda q, t: t.endswith("5")),
                            max_tokens=8)
    # every step when not last_only: the first partial's "a" again, and its own two steps
    assert verified.score_steps("Q", [partials[1]], ledger=Ledger()) == [[0.25, 0.25]]
    table_58 = {"Q": ["a\n\n"], "Qa\n\n": ["so 5", "so 5.0", "so 8", "so 9"]}
    equivalent = RolloutValue(ScriptedGenerator(table_58), k=4, extractor=MathAnswer(), max_tokens=8)
    assert equivalent.score_steps("Q", [["a\n\n"]], ledger=Ledger(), last_only=True) == [[0.5]]  # 5 = 5.0
    with pytest.raises(InvalidParameter, match="verifier"):
        RolloutValue(ScriptedGenerator(table), k=2)

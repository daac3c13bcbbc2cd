"""Refinement trees (`metaloom.search.refine_tree`): scripted candidates and a scripted verifier;
the REBASE allocation on hand-made scores, the stop on a pass, the parent's feedback in each
child's prompt, budget stops, and the tree in the trace."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from metaloom.cli import main
from metaloom.errors import InvalidParameter
from metaloom.generator.types import Request
from metaloom.ledger import Budget, Ledger
from metaloom.meta.refine import REVISE, revision_prompt
from metaloom.sampling.params import SamplingParams
from metaloom.score.feedback import ExecutionFeedback, FunctionFeedback, Verdict
from metaloom.score.protocols import Raw
from metaloom.search.rebase import rebase_widths
from metaloom.search.refine_tree import RefineTree
from metaloom.search.trace import check_tree
from metaloom.testing.scripted import ScriptedGenerator
from metaloom.wiring.spec import parse_spec

P = SamplingParams(temperature=0.7, max_tokens=16)


@dataclass
class TableFeedback:
    """Score by candidate text; passes at 1.0; the message names the candidate."""

    table: dict[str, float]
    name: str = "table"
    seen: list[str] = field(default_factory=list)

    def __call__(self, prompt, candidate, *, ledger) -> Verdict:
        ledger.charge(scorer_calls=1)
        text = candidate.text.strip()
        self.seen.append(text)
        return Verdict(self.table[text] >= 1.0, f"fix {text}", self.table[text])


class Counting(ScriptedGenerator):
    """Counts the requests of each generate call."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.calls: list[int] = []

    def generate(self, requests, *, ledger):
        self.calls.append(len(requests))
        return super().generate(requests, ledger=ledger)


def fix(parent: str, message: str | None = None) -> str:
    """The raw prompt refining ``parent`` given its feedback (default: the table feedback's)."""
    return str(revision_prompt("Q", parent, f"fix {parent}" if message is None else message, REVISE))


TABLE = {"Q": ["a", "b", "c"],
         fix("a"): ["a1", "a2", "a3"], fix("b"): ["b1"],
         fix("a2"): ["a21", "pass", "a23"], fix("b1"): ["b11"]}
SCORES = {"a": 0.9, "b": 0.8, "c": 0.1, "a1": 0.3, "a2": 0.7, "a3": 0.2, "b1": 0.6, "a21": 0.4, "pass": 1.0,
          "a23": 0.5, "b11": 0.5}


def tree_of(result):
    return next(e.data for e in result.trace if e.kind == "tree")


def by_text(tree):
    return {n["text"]: n for n in tree["nodes"][1:]}


def test_rebase_allocation_on_hand_made_scores() -> None:
    # softmax([0.9, 0.8, 0.1] / 0.1) ∝ (1, e^-1, e^-8) -> 4 x (0.7309, 0.2689, 0.0002) -> 3, 1, 0
    assert rebase_widths([0.9, 0.8, 0.1], 4, 0.1) == [3, 1, 0]
    # (0.3, 0.7, 0.2, 0.6) / 0.1 ∝ (e^-4, 1, e^-5, e^-1) -> 4 x (0.013, 0.718, 0.005, 0.264) -> 0, 3, 0, 1
    assert rebase_widths([0.3, 0.7, 0.2, 0.6], 4, 0.1) == [0, 3, 0, 1]


def test_expands_the_best_scored_by_rebase_and_stops_at_a_pass() -> None:
    gen, feedback = Counting(TABLE), TableFeedback(SCORES)
    result = RefineTree(feedback=feedback, initial=3, width=4, depth=3, temperature=0.1, params=P).run(
        Raw("Q"), gen, ledger=Ledger())
    tree = tree_of(result)
    check_tree(tree)
    nodes = by_text(tree)
    assert (nodes["a"]["width"], nodes["b"]["width"], nodes["c"]["state"]) == (3, 1, "pruned")
    assert (nodes["a2"]["width"], nodes["b1"]["width"]) == (3, 1)
    assert nodes["a1"]["state"] == nodes["a3"]["state"] == "pruned"
    assert [[tree["nodes"][p]["text"] for p in r["expanded"]] for r in tree["rounds"]] == [[""], ["a", "b"], ["a2", "b1"]]
    assert nodes["pass"]["parent"] == nodes["a2"]["id"] and nodes["pass"]["state"] == "finished"
    # stopped at the first pass: the rest of that round is not judged, no further round
    assert feedback.seen == ["a", "b", "c", "a1", "a2", "a3", "b1", "a21", "pass"]
    assert result.best == "pass" and result.stopped_reason is None and tree["stop"] == "passed"
    assert [c.text for c in result.candidates] == ["a", "b", "c", "a1", "a2", "a3", "b1", "a21", "pass", "a23", "b11"]
    assert result.scores[:9] == (0.9, 0.8, 0.1, 0.3, 0.7, 0.2, 0.6, 0.4, 1.0)
    assert all(math.isnan(s) for s in result.scores[9:])
    assert [r["usage"]["scorer_calls"] for r in tree["rounds"]] == [3, 4, 2]  # each round's verdicts in its cost
    assert gen.calls == [1, 2, 2]  # one generator call per round, a request per refined parent
    assert result.usage.scorer_calls == 9


def test_children_prompts_carry_the_parents_feedback() -> None:
    gen = ScriptedGenerator(TABLE)
    RefineTree(feedback=TableFeedback(SCORES), initial=3, width=4, depth=1, params=P).run(Raw("Q"), gen, ledger=Ledger())
    assert [(r.prompt, r.params.n) for r in gen.requests] == [("Q", 3), (fix("a"), 3), (fix("b"), 1)]
    assert "Feedback on your answer:\nfix a\n" in str(gen.requests[1].prompt)
    chat = ScriptedGenerator({"Q": ["a", "b", "c"], REVISE.format(feedback="fix a"): ["a1"]})  # a chat: its last user turn
    RefineTree(feedback=TableFeedback(SCORES), initial=3, width=1, depth=1, params=P).run(
        ({"role": "user", "content": "Q"},), chat, ledger=Ledger())
    refining = chat.requests[1].prompt
    assert isinstance(refining, tuple)
    assert refining[1:] == ({"role": "assistant", "content": "a"}, {"role": "user", "content": REVISE.format(feedback="fix a")})


def test_depth_limit_and_going_on_after_a_pass() -> None:
    feedback = TableFeedback(SCORES)
    result = RefineTree(feedback=feedback, initial=3, width=4, depth=1, params=P).run(
        Raw("Q"), ScriptedGenerator(TABLE), ledger=Ledger())
    assert tree_of(result)["stop"] == "finished" and len(result.candidates) == 7
    assert result.best == "a"  # nothing passed: the best score
    everything = TableFeedback(SCORES)
    result = RefineTree(feedback=everything, initial=3, width=4, depth=2, stop_on_pass=False, params=P).run(
        Raw("Q"), ScriptedGenerator(TABLE), ledger=Ledger())
    assert everything.seen[-4:] == ["a21", "pass", "a23", "b11"] and result.best == "pass"


def test_budget_stop_keeps_the_tree_and_the_best_judged() -> None:
    # round 0: 3 x (word + EOS) = 6 output tokens; round 1's first step brings 4 more, past 8
    ledger = Ledger(budget=Budget(output_tokens=8))
    result = RefineTree(feedback=TableFeedback(SCORES), initial=3, width=4, params=P).run(
        Raw("Q"), ScriptedGenerator(TABLE), ledger=ledger)
    assert result.stopped_reason == "budget" and result.best == "a"
    assert [c.finish_reason for c in result.candidates] == ["stop"] * 3 + ["budget"] * 4
    assert result.scores[:3] == (0.9, 0.8, 0.1) and all(math.isnan(s) for s in result.scores[3:])
    kinds = [e.kind for e in result.trace]
    assert kinds.index("budget") < kinds.index("tree") and tree_of(result)["stop"] == "budget"


def test_execution_feedback_reaches_the_refinement() -> None:
    wrong, right = "def double(x):\n    return x + 1\n", "def double(x):\n    return 2 * x\n"
    feedback = ExecutionFeedback(tests=("assert double(3) == 6",))
    first = ScriptedGenerator({"Q": [wrong]})
    ask = feedback("Q", first.generate([Request("Q", P)], ledger=Ledger())[0][0], ledger=Ledger()).message
    gen = ScriptedGenerator({"Q": [wrong], fix(wrong, ask): [right]})
    result = RefineTree(feedback=feedback, initial=1, width=1, depth=2, params=P).run(Raw("Q"), gen, ledger=Ledger())
    refining = str(gen.requests[1].prompt)
    assert refining.startswith("Q" + wrong) and "assert double(3) == 6" in refining and "failed" in refining
    assert result.best == right and result.scores == (0.0, 1.0)


def test_validation_registration_and_listing(capsys) -> None:
    for bad in ({"initial": 0}, {"width": 0}, {"depth": -1}, {"temperature": 0}, {"revise_template": "no field"},
                {"feedback": TableFeedback}):
        with pytest.raises(InvalidParameter):
            RefineTree(**bad)
    built = parse_spec("refine_tree@initial=2,width=3,depth=1,temperature=0.5,feedback=function,"
                       "feedback.fn=os.path:isabs").build({"generator": ScriptedGenerator(TABLE)})
    assert isinstance(built, RefineTree) and (built.initial, built.width, built.temperature) == (2, 3, 0.5)
    assert isinstance(built.feedback, FunctionFeedback)
    assert main(["strategies"]) == 0
    out = capsys.readouterr().out
    assert "refine_tree" in out and "--strategy.temperature" in out and "--strategy.stop_on_pass" in out


@pytest.mark.model
def test_on_the_default_model(smollm_generator) -> None:
    """Two answers, one round of two refinements, a verifier that never passes: the tree's shape
    and charges on the real model."""
    never = FunctionFeedback(lambda q, a: (False, "Mention a zebra."))
    config = RefineTree(feedback=never, initial=2, width=2, depth=1, params=SamplingParams(temperature=0.7,
                                                                                           max_tokens=12, seed=0))
    result = config.run(({"role": "user", "content": "Name a colour."},), smollm_generator, ledger=Ledger())
    tree = tree_of(result)
    assert [n["depth"] for n in tree["nodes"][1:]] == [1, 1, 2, 2] and tree["stop"] == "finished"
    assert len(result.candidates) == 4 and result.scores == (0.0,) * 4 and result.usage.scorer_calls == 4
    assert result.usage.output_tokens == sum(len(c.token_ids) for c in result.candidates)

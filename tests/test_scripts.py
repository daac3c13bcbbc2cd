"""The analysis scripts: tree_leaves.py (a finished leaf's solution is its path's text, its
score the node's) and reattribute_scorer.py (old records re-split as the runner now splits)."""

import dataclasses
import importlib.util
import pathlib

import pytest


def script(name):
    spec = importlib.util.spec_from_file_location(name, pathlib.Path(__file__).parents[1] / "scripts" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


tree_leaves = script("tree_leaves")


def node(i, parent, text, state, score=None):
    return {"id": i, "parent": parent, "text": text, "state": state, "score": score}


def test_leaves_are_the_finished_nodes_with_their_paths_text():
    old = {"kind": "tree", "nodes": [node(0, None, "", "expanded"), node(1, 0, "stale", "finished", 1.0)]}
    tree = {"kind": "tree", "nodes": [
        node(0, None, "", "expanded"), node(1, 0, "2 + 3 = 5\n\n", "expanded", 0.8),
        node(2, 1, "Answer: 5", "finished", 0.9), node(3, 1, "Answer: 6", "finished", 0.2),
        node(4, 0, "2 * 3 = 6\n\n", "pruned", 0.1), node(5, 4, "Answer: 6", "open", 0.3)]}
    # the last tree event is the final tree; open and pruned nodes are not solutions
    assert tree_leaves.leaves([old, {"kind": "expand"}, tree]) == [("2 + 3 = 5\n\nAnswer: 5", 0.9),
                                                                   ("2 + 3 = 5\n\nAnswer: 6", 0.2)]
    assert tree_leaves.leaves([{"kind": "expand"}]) == []


def test_an_old_record_is_re_split_as_the_runner_now_writes_it():
    from metaloom.eval.pool import attribute, candidates_of
    from metaloom.eval.records import Record
    from metaloom.eval.tasks.base import Grade
    from metaloom.generator.types import Completion
    from metaloom.ledger import Usage
    from metaloom.meta.types import Event, Result

    def row(prompt, tokens):  # a formula: the first token from the prefill, then one forward a token
        return 10.0 * max(0, tokens - 1)

    cands = tuple(Completion(t, (1,) * n, (-0.5,) * n, "stop") for t, n in (("a", 3), ("b", 5), ("c", 3)))
    usage = Usage(input_tokens=4, output_tokens=11, flops=1000.0, seconds=2.0, scorer_calls=1)
    result = Result(best="b", candidates=cands, usage=usage, best_index=1, scores=(0.1, 0.9, 0.4),
                    trace=(Event("sample", {"usage": {"input_tokens": 4, "flops": 600.0}}),
                           Event("score", {"usage": {"flops": 400.0}})))
    grades = [Grade(t, t == "b", float(t == "b")) for t in "abc"]

    def record(costs, shared):
        return Record("p", "best_of_n@n=3,scorer=judge", "b", True, 1.0, "b", usage.to_dict(), 2.0, None,
                      candidates=candidates_of(result, grades, costs), shared=shared)

    now = record(*attribute(result, row))
    # before 980dfd6: the judge's 400 in shared, each candidate its decode alone
    old_result = dataclasses.replace(result, trace=result.trace[:1])
    old = record(*attribute(old_result, row))
    assert old.shared["flops"] == pytest.approx(400.0 + 600.0 - 20 - 40 - 20)
    prefill = 600.0 - 20 - 40 - 20
    redone = script("reattribute_scorer").reattribute(old, prefill)
    assert [c.flops for c in redone.candidates] == pytest.approx([c.flops for c in now.candidates])
    assert [c.seconds for c in redone.candidates] == pytest.approx([c.seconds for c in now.candidates])
    assert redone.shared["flops"] == pytest.approx(now.shared["flops"]) == pytest.approx(prefill)
    assert script("reattribute_scorer").reattribute(redone, prefill) is redone  # once only

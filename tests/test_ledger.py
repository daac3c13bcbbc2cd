"""Ledger: charges, child ledgers, budgets."""

import dataclasses

import pytest

from metaloom.errors import BudgetExceeded, InvalidParameter
from metaloom.ledger import COUNTED, Budget, Ledger, Usage


def test_budget_can_cap_every_usage_field():
    assert [f.name for f in dataclasses.fields(Budget)] == list(COUNTED)
    assert set(COUNTED) == {f.name for f in dataclasses.fields(Usage)} - {"unknown", "estimated"}


def test_child_charges_reach_the_parent():
    parent = Ledger()
    child = parent.child()
    child.charge(input_tokens=3, output_tokens=2, flops=10.0)
    parent.charge(output_tokens=1)
    assert (child.usage.input_tokens, child.usage.output_tokens) == (3, 2)
    assert (parent.usage.input_tokens, parent.usage.output_tokens, parent.usage.flops) == (3, 3, 10.0)


def test_budget_records_the_charge_then_raises():
    ledger = Ledger(budget=Budget(output_tokens=5))
    ledger.charge(output_tokens=5)
    with pytest.raises(BudgetExceeded, match="output_tokens would be 6 > limit 5"):
        ledger.charge(output_tokens=1)
    assert ledger.usage.output_tokens == 6  # the work was done, so it is reported


def test_parent_budget_applies_to_child_charges():
    parent = Ledger(budget=Budget(forward_passes=2))
    with pytest.raises(BudgetExceeded):
        parent.child().charge(forward_passes=3)


def test_speculative_rates():
    u = Usage(drafted_tokens=10, accepted_tokens=6, verify_steps=3)
    assert (u.acceptance_rate, u.accepted_per_step) == (0.6, 2.0)
    assert Usage().acceptance_rate is None


def test_a_listener_hears_the_trace_events_of_runs_charged_below_it_as_they_happen():
    from metaloom.meta import MajorityVote
    from metaloom.testing.scripted import ScriptedGenerator

    heard: list[tuple[str, dict]] = []
    ledger = Ledger(listener=lambda kind, data: heard.append((kind, dict(data))))
    gen = ScriptedGenerator({"q": ["the answer is 4", "the answer is 5", "the answer is 4"]})
    result = MajorityVote(n=3).run("q", gen, ledger=ledger)
    assert [k for k, _ in heard] == [e.kind for e in result.trace] == ["sample", "vote"]
    assert heard[-1][1]["tally"] == {"4": 2.0, "5": 1.0}
    quiet = Ledger()  # no listener: nothing to tell, nothing breaks
    assert MajorityVote(n=3).run("q", ScriptedGenerator({"q": ["4", "5", "4"]}), ledger=quiet).answer == "4"


def test_unknown_figures_are_null_never_zero_and_a_budget_on_them_is_an_error():
    ledger = Ledger()
    ledger.charge(output_tokens=3, flops=6.0, unknown=frozenset({"forward_passes"}), estimated=frozenset({"flops"}))
    ledger.charge(output_tokens=2, forward_passes=1)  # an exact charge does not make the unknown known
    d = ledger.usage.to_dict()
    assert d["forward_passes"] is None and d["output_tokens"] == 5 and d["estimated"] == ["flops"]
    assert "estimated" not in Usage(output_tokens=1).to_dict()
    capped = Ledger(budget=Budget(forward_passes=10))
    with pytest.raises(InvalidParameter, match=r"budget\.forward_passes"):
        capped.charge(output_tokens=1, unknown=frozenset({"forward_passes"}))
    Ledger(budget=Budget(output_tokens=10)).charge(output_tokens=1, unknown=frozenset({"forward_passes"}))

"""Every strategy rejects every impossible parameter at construction, naming it (never clamps).

One table: (strategy, keyword arguments, the parameter the `InvalidParameter` must name). A
strategy registered in `metaloom.wiring.registry` without rows here fails
`test_every_registered_strategy_is_in_the_table`."""

import dataclasses

import pytest

from metaloom.errors import InvalidParameter
from metaloom.ledger import Ledger, Usage
from metaloom.meta import (
    MBR,
    AdaptiveVote,
    BestOfN,
    BudgetForcing,
    Chain,
    FirstFinish,
    MajorityVote,
    PrunedBestOfN,
    Refine,
    WeightedVote,
)
from metaloom.meta.refine import REVISE
from metaloom.meta.single import Single
from metaloom.meta.spec_reason import SpecReason
from metaloom.meta.tool_chain import ToolChain
from metaloom.sampling.params import SamplingParams
from metaloom.score.answers import LastNumber
from metaloom.score.feedback import FunctionFeedback
from metaloom.score.logprob import SequenceLogprob
from metaloom.testing.scripted import ScriptedGenerator
from metaloom.wiring.configure import build_strategy
from metaloom.wiring.registry import STRATEGIES, resolve

NAN, INF = float("nan"), float("inf")
from metaloom.score.feedback import ScorerFeedback  # noqa: E402
from metaloom.search.a_star import AStar  # noqa: E402
from metaloom.search.beam import DVTS, StepBeamSearch  # noqa: E402
from metaloom.search.best_first import BestFirst  # noqa: E402
from metaloom.search.entropic import EntropicParticleFiltering  # noqa: E402
from metaloom.search.lookahead import Lookahead  # noqa: E402
from metaloom.search.mcts import MCTS  # noqa: E402
from metaloom.search.particle import ParticleFiltering  # noqa: E402
from metaloom.search.rebase import Rebase  # noqa: E402
from metaloom.search.refine_tree import RefineTree  # noqa: E402
from metaloom.testing.scripted import ScriptedStepScorer  # noqa: E402

SEARCHES = (StepBeamSearch, DVTS, Lookahead, Rebase, MCTS, AStar, ParticleFiltering, BestFirst)
REQUIRED = {WeightedVote: {"scorer": SequenceLogprob()},  # fields without a default
            **{cls: {"step_scorer": ScriptedStepScorer({})} for cls in SEARCHES}}


def make(cls, **kwargs):
    return cls(**{**REQUIRED.get(cls, {}), **kwargs})


# values that are wrong for the same reason in every strategy that has the field
NOT_PARAMS = [{"temperature": 0.0}, None, "greedy"]
NOT_EXTRACTORS = ["math", LastNumber, 4]
NOT_STRATEGIES = ["chain", object(), Chain]
COUNTS = [0, -1, 2.5, True, "4", None]  # where an integer >= 1 is needed

CASES: list[tuple] = []


def case(cls, name, *values, **extra):
    for v in values:
        CASES.append((cls, {**extra, name: v}, name))


# Single (`greedy`): one call
case(Single, "params", *NOT_PARAMS)
case(Single, "extractor", *NOT_EXTRACTORS)

# Chain: templates over {prompt} and earlier {stepK}, one integer limit per step
case(Chain, "steps", "{prompt} think", (), (1, 2), max_tokens=(8, 8))
case(Chain, "steps", ("{prompt}", None), max_tokens=(8, 8))
case(Chain, "steps", ("no field at all",), ("{nope}",), ("{step1}",), ("{prompt",), ("{0}",), ("",), max_tokens=(8,))
case(Chain, "steps", ("{prompt}", "{step2}"), ("{prompt}", "constant"), max_tokens=(8, 8))
case(Chain, "max_tokens", (256,), (256, 32, 8), (256, 0), (256, True), (256, 2.5), (256, None), "256")
case(Chain, "stop", "\n", ("",), (1,), ("\n", None))
case(Chain, "params", *NOT_PARAMS)
case(Chain, "extractor", *NOT_EXTRACTORS)
# BestOfN
case(BestOfN, "n", *COUNTS)
case(BestOfN, "scorer", "logprob", None, lambda prompt, cands, ledger: [0.0], SequenceLogprob)
case(BestOfN, "params", *NOT_PARAMS)
case(BestOfN, "extractor", *NOT_EXTRACTORS)
case(BestOfN, "inner", *NOT_STRATEGIES)
# MajorityVote: a vote needs answers, so the extractor is not optional
case(MajorityVote, "n", *COUNTS)
case(MajorityVote, "extractor", None, *NOT_EXTRACTORS)
case(MajorityVote, "params", *NOT_PARAMS)
case(MajorityVote, "inner", *NOT_STRATEGIES)
# WeightedVote
case(WeightedVote, "scorer", None, "logprob")
case(WeightedVote, "n", *COUNTS)
case(WeightedVote, "extractor", None, *NOT_EXTRACTORS)
case(WeightedVote, "transform", "log", "EXP", "", None, ["exp"])
case(WeightedVote, "params", *NOT_PARAMS)
case(WeightedVote, "inner", *NOT_STRATEGIES)
# MBR
case(MBR, "n", *COUNTS)
case(MBR, "utility", "chrf", None, 0.5)
case(MBR, "params", *NOT_PARAMS)
case(MBR, "extractor", *NOT_EXTRACTORS)
case(MBR, "inner", *NOT_STRATEGIES)
# Refine: rounds counts revisions (0 is allowed: one answer and its feedback)
case(Refine, "rounds", -1, -5, 1.5, True, "3", None, INF)
case(Refine, "revise_template", "", "Try again.", "{feedback", "{feedback} {prompt}", "{0}", None, 3)
case(Refine, "feedback", "critique", 1.0)
case(Refine, "params", *NOT_PARAMS)
case(ToolChain, "tools", ("browser",), (), "calculator")
case(ToolChain, "corpus", "x.txt")
case(ToolChain, "max_steps", 0)
case(ToolChain, "top_k", 0)
case(ToolChain, "tool_timeout_s", 0, float("nan"))
case(ToolChain, "max_observation_chars", 0)
case(ToolChain, "constrained", "yes")
case(ToolChain, "force_answer", 1)
case(ToolChain, "template", "no field", None)
case(ToolChain, "params", *NOT_PARAMS)
case(ToolChain, "extractor", *NOT_EXTRACTORS)
# BudgetForcing
case(BudgetForcing, "min_thinking_tokens", -1, 513, True, 1.5, None, "0", NAN)
case(BudgetForcing, "min_thinking_tokens", 11, max_thinking_tokens=10)
case(BudgetForcing, "max_thinking_tokens", *COUNTS)
case(BudgetForcing, "answer_max_tokens", *COUNTS)
case(BudgetForcing, "think_start", None, 1)
case(BudgetForcing, "answer_prefix", None, 1)
case(BudgetForcing, "think_end", "", None, ("</think>",))
case(BudgetForcing, "wait", "", None)
case(BudgetForcing, "answer_stop", "\n", ("",), (None,), ("\n", ""))
case(BudgetForcing, "max_waits", -1, 1.5, True, "2")
case(BudgetForcing, "params", *NOT_PARAMS)
case(BudgetForcing, "extractor", *NOT_EXTRACTORS)
# FirstFinish
case(FirstFinish, "n", *COUNTS)
case(FirstFinish, "chunk_tokens", *COUNTS)
case(FirstFinish, "max_tokens", *COUNTS)
case(FirstFinish, "growth", 0.5, 0, -2.0, NAN, INF, True, "2", None)
case(FirstFinish, "mode", "batch", "ROUNDS", "", None)
case(FirstFinish, "params", *NOT_PARAMS)
# PrunedBestOfN
case(PrunedBestOfN, "n", *COUNTS)
case(PrunedBestOfN, "chunk_tokens", *COUNTS)
case(PrunedBestOfN, "min_keep", *COUNTS)
case(PrunedBestOfN, "min_keep", 9)  # more than the n=8 samples
case(PrunedBestOfN, "min_keep", 3, n=2)
case(PrunedBestOfN, "max_tokens", *COUNTS)
case(PrunedBestOfN, "keep_fraction", 0, 0.0, -0.5, 1.5, NAN, INF, True, "0.5", None)
case(PrunedBestOfN, "scorer", "logprob", None)
case(PrunedBestOfN, "params", *NOT_PARAMS)
# AdaptiveVote
case(AdaptiveVote, "batch", *COUNTS)
case(AdaptiveVote, "max_samples", *COUNTS)
case(AdaptiveVote, "min_samples", -1, 17, True, 2.5, None, "4")
case(AdaptiveVote, "min_samples", 5, max_samples=4)
case(AdaptiveVote, "rule", "majority", "Beta", "", None)
case(AdaptiveVote, "threshold", 0, 0.0, -0.1, 1.01, NAN, INF, True, "0.9", None)
case(AdaptiveVote, "extractor", None, *NOT_EXTRACTORS)
case(AdaptiveVote, "params", *NOT_PARAMS)

# tree searches: the common fields, then each one's own
for _cls in SEARCHES:
    case(_cls, "step_scorer", "countdown", None, ScriptedStepScorer, 3)
    case(_cls, "params", *NOT_PARAMS)
    case(_cls, "delimiter", (), ("",), "\n\n", (3,), None)
    case(_cls, "step_tokens", *COUNTS)
    case(_cls, "max_depth", *COUNTS)
    case(_cls, "aggregation", "median", "", None, "LAST")
    case(_cls, "select", "best", "", None)
    case(_cls, "select", "vote")  # a vote without an extractor
    case(_cls, "extractor", *NOT_EXTRACTORS)
    case(_cls, "final_scorer", "countdown", 3)
for _cls in (StepBeamSearch, DVTS, Lookahead):
    case(_cls, "n", *COUNTS)
    case(_cls, "beam_width", *COUNTS)
case(Lookahead, "k", -1, 1.5, True, "1", None)
case(Rebase, "n", *COUNTS)
case(Rebase, "temperature", 0, 0.0, -1.0, "0.1", None)
case(ParticleFiltering, "n", *COUNTS)
case(ParticleFiltering, "temperature", 0, -1.0, "1", None)
case(ParticleFiltering, "ess_threshold", -0.1, 1.5, "0.5", None)
REQUIRED[EntropicParticleFiltering] = {"step_scorer": ScriptedStepScorer({})}
case(EntropicParticleFiltering, "n", *COUNTS)
case(EntropicParticleFiltering, "step_scorer", "countdown", None)
case(EntropicParticleFiltering, "entropy_threshold", -0.1, 1.0, NAN, INF, True, "0.5", None)
case(EntropicParticleFiltering, "lookahead", -1, 1.5, True, "1", None)
for _field in ("iterations", "k", "parallel"):
    case(MCTS, _field, *COUNTS)
case(MCTS, "c", -1.0, "1", None)
for _cls in (AStar, BestFirst):
    for _field in ("k", "parallel", "solutions", "max_rounds"):
        case(_cls, _field, *COUNTS)
case(AStar, "cost_weight", -0.5, "0.1", None)
case(SpecReason, "drafter", "small", object())
case(SpecReason, "threshold", -0.1, 1.5, True, "0.5", None)
case(SpecReason, "method", "vote", None)
case(SpecReason, "max_steps", *COUNTS)
case(SpecReason, "delimiter", (), ("",), "\n\n", None)
case(SpecReason, "judge_template", "no step {prompt}", "{step} {answer}", None)
case(SpecReason, "params", *NOT_PARAMS)
case(SpecReason, "extractor", *NOT_EXTRACTORS)
case(RefineTree, "feedback", "tests", ScorerFeedback)
case(RefineTree, "initial", *COUNTS)
case(RefineTree, "width", *COUNTS)
case(RefineTree, "depth", -1, 2.5, True, "4", None)
case(RefineTree, "temperature", 0, -1.0, True, "0.1", None)
case(RefineTree, "stop_on_pass", "yes", 1, None)
case(RefineTree, "revise_template", "no field", "{answer}", None)
case(RefineTree, "params", *NOT_PARAMS)
case(RefineTree, "extractor", *NOT_EXTRACTORS)


def _id(c):
    cls, kwargs, name = c
    return f"{cls.__name__}-{name}={kwargs[name]!r}"[:80]


@pytest.mark.parametrize(("cls", "kwargs", "name"), CASES, ids=[_id(c) for c in CASES])
def test_impossible_parameters_are_rejected_by_name(cls, kwargs, name):
    with pytest.raises(InvalidParameter) as info:
        make(cls, **kwargs)
    err = info.value
    assert err.name == name, f"{err} should name {name!r}"
    bad = kwargs[name]
    # the error carries the offending value: the whole value, or the element at fault
    assert err.value is bad or (isinstance(bad, tuple | list) and any(err.value is v for v in bad)), err


def test_every_registered_strategy_is_in_the_table():
    tested = {cls for cls, _, _ in CASES}
    registered = {resolve(entry) for entry in STRATEGIES.values()}
    assert registered <= tested, f"no validation rows for {registered - tested}"


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_defaults_construct(name):
    s = make(resolve(STRATEGIES[name]))
    assert isinstance(s.params, SamplingParams)
    assert dataclasses.replace(s) == s  # re-validates the defaults


@pytest.mark.parametrize(("cls", "kwargs"), [
    (Chain, {"steps": ("{prompt}", "{step1} and {prompt}", "{step2}"), "max_tokens": (1, 2, 3), "stop": ("\n",)}),
    (Chain, {"steps": ("{{literal}} {prompt}",), "max_tokens": (1,)}),
    (Chain, {"steps": ["{prompt}", "{step1}"], "max_tokens": [4, 4], "stop": ["\n"]}),  # lists work as well
    (Refine, {"rounds": 0}),
    (Refine, {"revise_template": "{feedback}", "feedback": FunctionFeedback(lambda q, t: (True, ""))}),
    (BudgetForcing, {"min_thinking_tokens": 512, "max_waits": 0, "think_start": "", "answer_prefix": ""}),
    (BudgetForcing, {"min_thinking_tokens": 1, "max_thinking_tokens": 1, "answer_stop": ("\n",)}),
    (FirstFinish, {"growth": 1, "mode": "stream"}),
    (FirstFinish, {"growth": 1.0, "n": 1, "chunk_tokens": 1, "max_tokens": 1}),
    (PrunedBestOfN, {"keep_fraction": 1.0, "min_keep": 8}),
    (PrunedBestOfN, {"keep_fraction": 1, "n": 1, "min_keep": 1}),
    (AdaptiveVote, {"min_samples": 0, "threshold": 1.0, "rule": "share"}),
    (AdaptiveVote, {"min_samples": 16, "threshold": 1, "batch": 32}),
    (BestOfN, {"n": 1, "inner": Chain()}),
    (MajorityVote, {"n": 1, "extractor": LastNumber(), "inner": BestOfN()}),
    (WeightedVote, {"transform": "exp", "n": 1}),
    (MBR, {"n": 1, "utility": lambda hyps, refs: [[1.0] * len(refs) for _ in hyps]}),
], ids=lambda v: getattr(v, "__name__", "") or "")
def test_boundary_values_are_allowed(cls, kwargs):
    s = make(cls, **kwargs)
    for key, value in kwargs.items():
        assert getattr(s, key) == value  # kept as given: nothing clamped


def test_refine_with_zero_rounds_answers_once_and_asks_for_feedback_once():
    g = ScriptedGenerator({"Q": ["5"], REVISE.format(feedback="wrong"): ["4"]})
    ledger = Ledger()
    r = Refine(feedback=FunctionFeedback(lambda q, text: (False, "wrong")), rounds=0).run("Q", g, ledger=ledger)
    assert (r.best, r.best_index, r.scores, r.stopped_reason) == ("5", 0, (0.0,), None)
    assert [e.kind for e in r.trace] == ["generate", "feedback"]
    assert r.usage == ledger.usage == Usage(input_tokens=1, output_tokens=2, forward_passes=2, scorer_calls=1)
    assert len(g.requests) == 1


def test_the_command_line_path_reports_the_same_error():
    with pytest.raises(InvalidParameter) as info:
        build_strategy("refine", {"rounds": "-1"})
    assert (info.value.name, info.value.value) == ("rounds", -1)
    with pytest.raises(InvalidParameter, match="keep_fraction"):
        build_strategy("pruned_best_of_n", {"keep_fraction": "nan"})
    with pytest.raises(InvalidParameter, match="mode"):
        build_strategy("first_finish", {"mode": "fastest"})

"""SpecReason (`metaloom.meta.spec_reason`): a scripted small model drafts each step, a scripted
large model judges it and rewrites the rejected ones; golden step texts, writers and charges."""

from __future__ import annotations

import math
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from metaloom.cli import main
from metaloom.errors import InvalidParameter, Unsupported
from metaloom.generator.capabilities import Capabilities
from metaloom.ledger import Budget, Ledger, Usage
from metaloom.meta.spec_reason import SpecReason
from metaloom.sampling.params import SamplingParams
from metaloom.score.answers import LastNumber
from metaloom.score.prompting import fill
from metaloom.score.step_judge import STEP_TEMPLATE
from metaloom.testing.scripted import CAPABILITIES, Say, ScriptedGenerator
from metaloom.wiring.spec import parse_spec

P = SamplingParams(temperature=0.0, max_tokens=32)
S1, S2_DRAFT, S2_LARGE, S3 = "Let x be 2.\n\n", "Then y is 5.\n\n", "Then y is 3.\n\n", "Answer: 5"


def small() -> ScriptedGenerator:
    return ScriptedGenerator({"Q\n": [S1], "Q\n" + S1: [S2_DRAFT], "Q\n" + S1 + S2_LARGE: [S3]})


def large() -> ScriptedGenerator:
    # the large model's per-token probability of each drafted step: 0.9, 0.2, 0.8
    return ScriptedGenerator({"Q\n" + S1: [S2_LARGE]},
                             likelihoods={"Let x be 2.": math.log(0.9), "Then y is 5.": math.log(0.2),
                                          "Answer: 5": math.log(0.8)})


def steps(result):
    return [e.data for e in result.trace if e.kind == "step"]


def models(result):
    return next(e.data for e in result.trace if e.kind == "models")


def test_accepts_drafts_above_threshold_and_rewrites_below() -> None:
    big, little = large(), small()
    config = SpecReason(drafter=little, threshold=0.5, method="likelihood", params=P, extractor=LastNumber())
    result = config.run("Q\n", big, ledger=Ledger())
    got = steps(result)
    assert [s["draft"] for s in got] == [S1, S2_DRAFT, S3]
    assert [s["score"] for s in got] == pytest.approx([0.9, 0.2, 0.8])
    assert [s["accepted"] for s in got] == [True, False, True]
    assert [s["writer"] for s in got] == ["small", "large", "small"]
    assert [s["text"] for s in got] == [S1, S2_LARGE, S3]
    assert result.best == S1 + S2_LARGE + S3 and result.answer == "5"
    assert result.stopped_reason is None and result.candidates[0].finish_reason == "stop"
    assert len(result.candidates) == 1 and result.candidates[0].token_ids == ()  # two models' ids never mixed
    # the large model wrote only the rejected step, continuing the kept text
    assert [r.prompt for r in big.requests] == ["Q\n" + S1]
    assert [r.prompt for r in little.requests] == ["Q\n", "Q\n" + S1, "Q\n" + S1 + S2_LARGE]


def test_threshold_is_inclusive_and_decides_the_writer() -> None:
    strict = SpecReason(drafter=small(), threshold=0.95, method="likelihood", params=P, max_steps=1)
    assert steps(strict.run("Q\n", ScriptedGenerator({"Q\n": [S1.upper()]}, likelihoods={"Let x be 2.": math.log(0.9)}),
                            ledger=Ledger()))[0]["writer"] == "large"
    lenient = SpecReason(drafter=small(), threshold=0.0, method="likelihood", params=P)
    result = lenient.run("Q\n", large(), ledger=Ledger())
    assert [s["writer"] for s in steps(result)][:2] == ["small", "small"]


def test_ledger_charges_each_model_separately() -> None:
    parent = Ledger()
    result = SpecReason(drafter=small(), method="likelihood", params=P).run("Q\n", large(), ledger=parent)
    split = models(result)
    # small: three drafts. Prompts of 2, 6 and 10 words; 5 + 5 + 3 tokens out (the last with its EOS)
    assert split["small"] == {"input_tokens": 18, "output_tokens": 13, "forward_passes": 13}
    # large: three judgements (context + step scored: 2+5, 6+5, 10+2 tokens, two passes and a
    # scorer call each) and the rewrite of step 2 (6 words in, 5 tokens out, 5 passes)
    assert split["large"] == {"input_tokens": 7 + 11 + 12 + 6, "output_tokens": 5, "forward_passes": 11,
                              "scorer_calls": 3}
    assert result.usage == Usage(input_tokens=54, output_tokens=18, forward_passes=24, scorer_calls=3)
    assert parent.usage == result.usage
    per_step = steps(result)
    assert per_step[1]["large_usage"] == {"input_tokens": 17, "output_tokens": 5, "forward_passes": 7, "scorer_calls": 1}
    assert per_step[0]["large_usage"] == {"input_tokens": 7, "forward_passes": 2, "scorer_calls": 1}


def test_step_limit() -> None:
    result = SpecReason(drafter=small(), method="likelihood", params=P, max_steps=2).run("Q\n", large(), ledger=Ledger())
    assert len(steps(result)) == 2 and result.best == S1 + S2_LARGE
    assert result.candidates[0].finish_reason == "length" and result.stopped_reason is None


def test_budget_stop_keeps_the_kept_steps() -> None:
    # 5 output tokens for step 1; the second draft passes 7 at its third token
    ledger = Ledger(budget=Budget(output_tokens=7))
    result = SpecReason(drafter=small(), method="likelihood", params=P).run("Q\n", large(), ledger=ledger)
    assert result.stopped_reason == "budget"
    assert result.best == S1 and result.candidates[0].finish_reason == "budget"
    cut = steps(result)[-1]
    assert cut == {**cut, "writer": "small", "draft": "Then y is", "finish": "budget", "accepted": None}
    assert any(e.kind == "budget" and e.data["field"] == "output_tokens" for e in result.trace)
    assert models(result)["small"]["output_tokens"] == 8


def test_judge_method_reads_the_large_models_yes() -> None:
    def question(step: str, previous: str = "(none)") -> str:
        return fill(STEP_TEMPLATE, "t", prompt="Q\n", previous=previous, step=step)

    big = ScriptedGenerator({question("Let x be 2."): [Say("Yes", -0.1), Say("No", -3.0)],
                             question("Then y is 5.", "Let x be 2."): [Say("Yes", -3.0), Say("No", -0.1)],
                             question("Answer: 5", "Let x be 2.\n\nThen y is 3."): [Say("Yes", -0.1), Say("No", -3.0)],
                             "Q\n" + S1: [S2_LARGE]})
    result = SpecReason(drafter=small(), params=P).run("Q\n", big, ledger=Ledger())
    got = steps(result)
    assert [s["writer"] for s in got] == ["small", "large", "small"]
    assert got[0]["score"] == pytest.approx(1 / (1 + math.exp(-2.9)))
    assert result.best == S1 + S2_LARGE + S3


def test_the_model_being_run_drafts_without_a_drafter() -> None:
    gen = ScriptedGenerator({"Q\n": [S1], "Q\n" + S1: [S3]}, likelihoods={"Let x be 2.": 0.0, "Answer: 5": 0.0})
    result = SpecReason(method="likelihood", params=P).run("Q\n", gen, ledger=Ledger())
    assert result.best == S1 + S3 and len(result.candidates[0].token_ids) == 8  # one model: its ids are kept


def test_validation_and_a_large_model_that_cannot_score() -> None:
    for bad in ({"threshold": 1.5}, {"method": "vote"}, {"max_steps": 0}, {"delimiter": ()},
                {"judge_template": "no step here {prompt}"}, {"drafter": "small"}):
        with pytest.raises(InvalidParameter):
            SpecReason(**bad)
    blind = small()
    blind.capabilities = Capabilities(sampling=CAPABILITIES.sampling, decoders=frozenset(), constraints=frozenset(),
                                      features=CAPABILITIES.features - {"score"})
    with pytest.raises(Unsupported):
        SpecReason(drafter=small()).run("Q\n", blind, ledger=Ledger())
    assert blind.requests == []  # refused before any compute


def test_registered_and_documented(capsys) -> None:
    built = parse_spec("spec_reason@threshold=0.7,method=likelihood,max_steps=3").build({"generator": large()})
    assert isinstance(built, SpecReason) and built.threshold == 0.7 and built.drafter is None
    assert main(["strategies"]) == 0
    out = capsys.readouterr().out
    assert "spec_reason" in out and "--strategy.threshold" in out and "--strategy.max_steps" in out


@pytest.mark.model
def test_on_the_default_model(smollm_generator) -> None:
    """The default model drafts and judges its own steps, a few short ones. At threshold 1 every
    step is rejected and rewritten greedily by the same model, so each rewrite is its draft."""
    prompt = ({"role": "user", "content": "Write three short paragraphs about the sea."},)
    params = SamplingParams(temperature=0.0, max_tokens=24)
    result = SpecReason(threshold=1.0, method="likelihood", max_steps=2, params=params).run(
        prompt, smollm_generator, ledger=Ledger())
    got = steps(result)
    assert 1 <= len(got) <= 2 and result.stopped_reason is None
    assert all(0.0 < s["score"] < 1.0 and s["writer"] == "large" and s["text"] == s["draft"] for s in got)
    assert result.best == "".join(s["text"] for s in got)
    split = models(result)
    assert split["small"]["output_tokens"] == split["large"]["output_tokens"] > 0
    assert split["large"]["scorer_calls"] == len(got) and split["steps_by_large"] == len(got)
    assert result.usage.output_tokens == 2 * split["small"]["output_tokens"]

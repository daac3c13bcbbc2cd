"""Tree search on the real default model: exact step continuation (a greedy one-beam search is
plain greedy decoding), the judge and rollout step scorers through `Generator`, and
`metaloom run ... --json` / `metaloom tree` end to end."""

from __future__ import annotations

import json

import pytest

from metaloom.cli import main
from metaloom.generator.types import Request
from metaloom.ledger import Ledger
from metaloom.sampling.params import SamplingParams
from metaloom.score.answers import LastNumber
from metaloom.score.rollout import RolloutValue
from metaloom.score.step_judge import StepJudge
from metaloom.search.beam import StepBeamSearch
from metaloom.search.particle import ParticleFiltering
from metaloom.testing.scripted import ScriptedStepScorer

PROMPT = ({"role": "user", "content": "Write three short paragraphs about the sea."},)


def test_greedy_step_search_equals_greedy_decoding(smollm_generator) -> None:
    """Cutting the answer into steps at each blank line and continuing each step from its token
    ids gives exactly the tokens of one uninterrupted greedy generation."""
    greedy = SamplingParams(temperature=0.0, max_tokens=120)
    plain = smollm_generator.generate([Request(PROMPT, greedy)], ledger=Ledger())[0][0]
    result = StepBeamSearch(step_scorer=ScriptedStepScorer({}, default=0.5), n=1, beam_width=1, params=greedy,
                            delimiter=("\n\n",)).run(PROMPT, smollm_generator, ledger=Ledger())
    tree = next(e.data for e in result.trace if e.kind == "tree")
    assert len(tree["rounds"]) >= 2, "the answer should span several steps"
    assert result.candidates[0].token_ids == plain.token_ids
    assert result.best == plain.text
    steps = [n["text"] for n in tree["nodes"][1:]]
    assert all(s.endswith("\n\n") for s in steps[:-1])


def test_judge_and_rollout_step_scorers_on_the_model(smollm_generator) -> None:
    question = ({"role": "user", "content": "What is 2 + 3?"},)
    partials = [["2 + 3 = 5.\n\n"], ["2 + 3 = 7.\n\n", "So the answer is 7."]]
    ledger = Ledger()
    judged = StepJudge(smollm_generator).score_steps(question, partials, ledger=ledger)
    assert [len(p) for p in judged] == [1, 2] and all(0.0 <= v <= 1.0 for p in judged for v in p)
    assert ledger.usage.scorer_calls == 1 and ledger.usage.input_tokens > 0
    last = StepJudge(smollm_generator).score_steps(question, partials, ledger=Ledger(), last_only=True)
    assert [len(p) for p in last] == [1, 1] and last[1][0] == pytest.approx(judged[1][1], abs=1e-6)
    rollout = RolloutValue(smollm_generator, k=3, extractor=LastNumber(), max_tokens=24, seed=0)
    ledger = Ledger()
    values = rollout.score_steps(question, partials, ledger=ledger, last_only=True)
    assert [len(v) for v in values] == [1, 1]
    assert all(v[0] in (0.0, 1 / 3, 2 / 3, 1.0) for v in values)  # a fraction of 3 rollouts
    assert ledger.usage.output_tokens > 0 and ledger.usage.scorer_calls == 1


def test_particle_filtering_with_the_judge_runs_and_charges(smollm_generator) -> None:
    params = SamplingParams(temperature=0.8, max_tokens=48, seed=3)
    result = ParticleFiltering(step_scorer=StepJudge(smollm_generator), n=3, step_tokens=16, params=params).run(
        ({"role": "user", "content": "Count from 1 to 5, one number per paragraph."},), smollm_generator,
        ledger=Ledger())
    tree = next(e.data for e in result.trace if e.kind == "tree")
    assert result.best_index is not None and result.candidates
    assert result.usage.scorer_calls == len(tree["rounds"])
    assert sum(r["usage"]["output_tokens"] for r in tree["rounds"]) <= result.usage.output_tokens


def test_run_json_then_tree(tmp_path, capsys) -> None:
    code = main(["run", "Make 24 using 8, 5, 10, 6. You can only use each number once.", "--strategy",
                 "step_beam_search", "--strategy.step_scorer", "game24", "--strategy.n", "2", "--strategy.beam_width",
                 "1", "--strategy.step_tokens", "12", "--max-tokens", "36", "--seed", "0", "--json"])
    out = capsys.readouterr().out
    assert code == 0
    result = json.loads(out)
    tree = next(e for e in result["trace"] if e["kind"] == "tree")
    assert tree["strategy"] == "step_beam_search" and tree["nodes"][0]["state"] == "root"
    assert result["usage"]["scorer_calls"] == len(tree["rounds"])
    path = tmp_path / "result.json"
    path.write_text(out)
    assert main(["tree", str(path)]) == 0
    rendered = capsys.readouterr().out
    assert "step_beam_search" in rendered

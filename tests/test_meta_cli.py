"""`metaloom run` / `metaloom strategies`, and building strategies from text parameters."""

import json
import operator

import pytest

from metaloom.cli import main
from metaloom.errors import InvalidParameter
from metaloom.meta import BestOfN, Chain, MajorityVote, Refine
from metaloom.meta.configure import build_strategy
from metaloom.meta.registry import STRATEGIES
from metaloom.score.answers import ChoiceLetter, LastNumber
from metaloom.score.feedback import ScorerFeedback
from metaloom.score.logprob import SequenceLogprob
from metaloom.score.verifier import FunctionVerifier


def test_build_converts_to_the_declared_types():
    s = build_strategy("majority_vote", {"n": "5", "extractor": "choice"}, {"extractor": {"letters": "ABCD"}})
    assert s == MajorityVote(n=5, extractor=ChoiceLetter(letters="ABCD"))
    s = build_strategy("chain", {"steps": '["{prompt} a", "b, c {step1}"]', "max_tokens": "8,2", "stop": '["\\n"]'})
    assert s == Chain(steps=("{prompt} a", "b, c {step1}"), max_tokens=(8, 2), stop=("\n",))
    s = build_strategy("best_of_n", {"scorer": "verifier", "inner": "none"},
                       {"scorer": {"fn": "operator:contains"}})
    assert s == BestOfN(scorer=FunctionVerifier(operator.contains))
    s = build_strategy("refine", {"feedback": "verifier", "rounds": "0"},
                       {"feedback": {"scorer": "logprob", "threshold": "-1.5"}, "scorer": {"normalize": "true"}})
    assert s == Refine(feedback=ScorerFeedback(SequenceLogprob(normalize=True), threshold=-1.5), rounds=0)
    s = build_strategy("majority_vote", {"inner": "chain"}, {"inner": {"max_tokens": "64,8"}, "extractor": {}})
    assert s.inner == Chain(max_tokens=(64, 8))


def test_a_judge_gets_the_model_being_run():
    marker = object()
    s = build_strategy("best_of_n", {"scorer": "judge"}, {"scorer": {"method": "sample"}}, {"generator": marker})
    assert s.scorer.generator is marker and s.scorer.method == "sample"


@pytest.mark.parametrize(("name", "params", "groups", "match"), [
    ("nope", {}, {}, r"invalid strategy='nope': allowed one of \['adaptive_vote', 'best_of_n'"),
    ("best_of_n", {"bogus": "1"}, {}, r"invalid strategy.bogus='1': allowed one of \['n', 'scorer', 'params', 'extractor'"),
    ("best_of_n", {"scorer": "oracle"}, {}, r"invalid scorer='oracle': allowed one of \['execution', 'judge', 'logprob'"),
    ("best_of_n", {"n": "many"}, {}, r"invalid strategy.n='many': allowed a value of type int"),
    ("best_of_n", {"n": "0"}, {}, r"invalid n=0"),
    ("best_of_n", {"scorer": "logprob"}, {"scorer": {"normalise": "1"}}, r"scorer.normalise.*one of \['normalize'\]"),
    ("best_of_n", {}, {"scorer": {"normalize": "true"}}, r"scorer\.\*"),
    ("weighted_vote", {}, {}, r"strategy.scorer.*required"),
    ("best_of_n", {"params": "x"}, {}, r"sampling flags"),
    ("majority_vote", {"extractor": "code_tests"}, {}, r"extractor.tests.*required"),
    ("best_of_n", {"scorer": "verifier"}, {"scorer": {"fn": "os.path"}}, r"'module.path:function'"),
])
def test_build_errors_name_the_valid_choices(name, params, groups, match):
    with pytest.raises(InvalidParameter, match=match):
        build_strategy(name, params, groups)


@pytest.mark.parametrize(("argv", "match"), [
    (["--strategy", "nope"], "invalid strategy='nope': allowed one of"),
    (["--strategy", "best_of_n", "--strategy.bogus", "1"], "invalid strategy.bogus='1'"),
    (["--strategy", "best_of_n", "--strategy.n"], "invalid strategy.n=None: allowed a value"),
    (["--strategy", "best_of_n", "--n", "3"], "strategy's --strategy.n"),
    (["--strategy", "best_of_n", "--temperature", "-1"], "invalid temperature=-1.0"),
    (["--strategy", "best_of_n", "--budget", "tokens=3"], "FIELD=LIMIT with FIELD one of"),
])
def test_cli_errors_before_loading_the_model(capsys, argv, match):
    assert main(["run", "What is 2 + 2?", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and match in err


def test_dotted_values_never_become_the_prompt(capsys):
    assert main(["run", "--strategy", "best_of_n", "--strategy.n", "0", "the prompt"]) == 2
    assert "invalid n=0" in capsys.readouterr().err  # "0" went to n, "the prompt" to the prompt


def test_strategies_lists_every_strategy_and_component(capsys):
    assert main(["strategies"]) == 0
    out = capsys.readouterr().out
    for name in [*STRATEGIES, "logprob", "reward_model", "judge", "verifier", "execution", "math", "last_number",
                 "choice", "exact", "code_tests", "chrf", "critique", "tests"]:
        assert f"\n  {name}  " in out
    assert "--strategy.n  int = 4" in out and "--scorer.path  str = (required)" in out


@pytest.mark.model
def test_cli_json_run_on_the_default_model(capsys):
    argv = ["run", "--strategy", "best_of_n", "--strategy.n", "2", "--strategy.extractor", "last_number",
            "What is 2 + 2?", "--max-tokens", "8", "--seed", "0", "--json", "--budget", "output_tokens=1000"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["strategy"] == "best_of_n" and out["stopped_reason"] is None
    assert len(out["candidates"]) == 2 and len(out["scores"]) == 2 and len(out["answers"]) == 2
    assert out["best"] == out["candidates"][out["best_index"]]["text"]
    assert out["usage"]["scorer_calls"] == 1 and 2 <= out["usage"]["output_tokens"] <= 16
    assert [e["kind"] for e in out["trace"]] == ["sample", "score", "select"]
    assert isinstance(LastNumber(), LastNumber)

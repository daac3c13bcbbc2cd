"""`metaloom run` / `metaloom strategies`, and building strategies from text parameters."""

import json
import operator

import pytest

from metaloom.cli import build_parser, main
from metaloom.commands.run import parse_budget, strategy_config
from metaloom.errors import InvalidParameter
from metaloom.ledger import Budget
from metaloom.meta import BestOfN, Chain, MajorityVote, Refine
from metaloom.score.answers import ChoiceLetter, LastNumber, MathAnswer
from metaloom.score.feedback import ScorerFeedback
from metaloom.score.logprob import SequenceLogprob
from metaloom.score.verifier import FunctionVerifier
from metaloom.wiring.configure import build_strategy
from metaloom.wiring.registry import STRATEGIES


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
    ("nope", {}, {}, r"invalid strategy='nope': allowed one of \['a_star', 'adaptive_vote', 'best_first', 'best_of_n'"),
    ("best_of_n", {"bogus": "1"}, {}, r"invalid strategy.bogus='1': allowed one of \['n', 'scorer', 'extractor', 'inner'\]$"),
    ("best_of_n", {"scorer": "judge"}, {"scorer": {"bogus": "1"}},
     r"scorer.bogus='1': allowed one of \['method', 'template', 'yes', 'no'\]$"),
    ("best_of_n", {"scorer": "judge"}, {"scorer": {"generator": "x"}}, r"scorer.generator='x'.*the model being run"),
    ("best_of_n", {"scorer": "oracle"}, {},
     r"invalid scorer='oracle': allowed one of \['countdown', 'execution', 'game24', 'judge', 'logprob'"),
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


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_unknown_parameter_offers_only_what_the_command_line_can_set(name):
    with pytest.raises(InvalidParameter) as info:
        build_strategy(name, {"bogus": "1"}, {})
    offered = info.value.allowed.removeprefix("one of ")
    assert offered.startswith("[") and "'params'" not in offered  # sampling params: the sampling flags
    with pytest.raises(InvalidParameter, match="sampling flags instead"):
        build_strategy(name, {"params": "x"}, {})


def parsed(*argv):
    """`metaloom run` arguments as `run` sees them, and what `strategy_config` makes of them."""
    args = build_parser().parse_args(["run", *argv])
    return args, strategy_config(args)


def test_cli_parameters_configure_the_strategy_and_its_components():
    args, (params, groups, sampling, _) = parsed(
        "--strategy", "best_of_n", "--strategy.n", "3", "--strategy.scorer", "logprob", "--scorer.normalize", "true",
        "--strategy.extractor=last_number", "Which is larger, 900 or 1,000?", "--temperature", "0.5", "--seed", "7")
    assert args.prompt == "Which is larger, 900 or 1,000?"
    assert (params, groups) == ({"n": "3", "scorer": "logprob", "extractor": "last_number"}, {"scorer": {"normalize": "true"}})
    assert sampling == {"temperature": 0.5, "seed": 7}  # only the flags given override the strategy's defaults
    s = build_strategy(args.strategy, params, groups)
    assert type(s) is BestOfN and s.n == 3 and s.inner is None
    assert type(s.scorer) is SequenceLogprob and s.scorer.normalize is True
    assert type(s.extractor) is LastNumber and s.extractor.extract(args.prompt) == "1000"
    args, (params, groups, _, _) = parsed("--strategy", "majority_vote", "Q", "--strategy.inner", "chain",
                                       "--inner.max_tokens", "64,8")
    s = build_strategy(args.strategy, params, groups)
    assert type(s) is MajorityVote and type(s.extractor) is MathAnswer and s.n == MajorityVote().n
    assert type(s.inner) is Chain and s.inner.max_tokens == (64, 8)


def test_run_reads_the_strategy_text_once_and_builds_it_after_the_load(monkeypatch):
    """`metaloom run` checks everything before a model loads and builds the strategy after it,
    from one reading of the text: each parameter converted once (it used to be read twice, a
    dry pass and then the real one)."""
    from metaloom.wiring import configure

    seen = []
    real = configure.convert
    monkeypatch.setattr(configure, "convert", lambda value, t, where, *rest: seen.append(where) or real(value, t, where, *rest))
    _, config = parsed("--strategy", "best_of_n", "--strategy.n", "3", "--strategy.scorer", "judge",
                       "--scorer.method", "sample", "Q")
    assert sorted(seen) == ["scorer.method", "strategy.n", "strategy.scorer"]
    marker = object()
    s = config.plan.build({"generator": marker})  # the model being run reaches the judge now
    assert type(s) is BestOfN and s.n == 3 and s.scorer.generator is marker and s.scorer.method == "sample"
    assert sorted(seen) == ["scorer.method", "strategy.n", "strategy.scorer"]  # nothing read again
    with pytest.raises(InvalidParameter, match="a model to run"):
        config.plan.build({})


def test_run_sends_chat_messages_or_with_raw_the_text_as_it_is():
    from metaloom.commands.run import run_prompt
    from metaloom.score.protocols import Raw, as_chat

    args, _ = parsed("--strategy", "greedy", "--system", "Be brief.", "Q")
    assert run_prompt(args) == ({"role": "system", "content": "Be brief."}, {"role": "user", "content": "Q"})
    args, _ = parsed("--strategy", "greedy", "--raw", "Q:")
    raw = run_prompt(args)
    assert type(raw) is Raw and raw == "Q:" and as_chat(raw) is raw  # not read as a chat message


def test_budget_limits_are_typed_numbers():
    b = parse_budget(["output_tokens=2000", "flops=1e9", "seconds=2.5"])
    assert b == Budget(output_tokens=2000, flops=1e9, seconds=2.5) and type(b.output_tokens) is int
    assert parse_budget([]) == Budget()
    with pytest.raises(InvalidParameter, match=r"budget\.output_tokens='9': allowed one limit"):
        parse_budget(["output_tokens=1", "output_tokens=9"])  # not silently the last one


def test_a_budget_in_a_strategy_spec_reaches_run_and_the_server():
    import argparse

    from metaloom.server.strategy import resolve_model
    from metaloom.wiring.spec import check_spec, parse_spec

    spec = check_spec("majority_vote@n=3,budget.flops=8e12,budget.output_tokens=500")
    assert spec.budget() == Budget(flops=8e12, output_tokens=500) and parse_spec("majority_vote@n=3").budget() is None
    with pytest.raises(InvalidParameter, match=r"budget\.flops='lots'"):
        check_spec("majority_vote@n=3,budget.flops=lots")
    # `metaloom run --strategy SPEC`: the spec's limits join --budget's
    ns = argparse.Namespace(strategy="majority_vote@n=3,budget.output_tokens=40", prompt="q", dotted=[],
                            budget=["flops=1e9"])
    params, groups, _, _ = strategy_config(ns)
    assert params == {"n": "3"} and groups == {} and parse_budget(ns.budget) == Budget(output_tokens=40, flops=1e9)
    ns = argparse.Namespace(strategy="majority_vote@budget.output_tokens=40", prompt="q", dotted=[],
                            budget=["output_tokens=9"])
    with pytest.raises(InvalidParameter, match="one limit"):  # set both ways: not silently one of them
        strategy_config(ns)
    # the server's model alias STRATEGY@...:MODEL caps each request's run
    call = resolve_model("majority_vote@n=3,budget.output_tokens=40:default", ("default",), None)
    assert call is not None and call.budget == Budget(output_tokens=40) and "budget" not in call.groups


@pytest.mark.parametrize(("item", "match"), [
    ("output_tokens=abc", "invalid budget.output_tokens='abc': allowed a whole number >= 0"),
    ("output_tokens=1.5", "invalid budget.output_tokens='1.5': allowed a whole number >= 0"),
    ("output_tokens=", "invalid budget.output_tokens='': allowed a whole number >= 0"),
    ("output_tokens=-5", "invalid budget.output_tokens='-5': allowed a whole number >= 0"),
    ("flops=nan", "invalid budget.flops='nan': allowed a finite number >= 0"),
    ("flops=inf", "invalid budget.flops='inf': allowed a finite number >= 0"),
    ("seconds=-0.5", "invalid budget.seconds='-0.5': allowed a finite number >= 0"),
    ("seconds=soon", "invalid budget.seconds='soon': allowed a finite number >= 0"),
    ("tokens=3", "invalid budget='tokens=3': allowed FIELD=LIMIT with FIELD one of ['input_tokens'"),
    ("output_tokens", "invalid budget='output_tokens': allowed FIELD=LIMIT"),
])
def test_bad_budgets_name_the_field(item, match):
    with pytest.raises(InvalidParameter) as info:
        parse_budget([item])
    assert str(info.value).startswith(match)


@pytest.mark.parametrize(("argv", "match"), [
    (["--strategy", "nope"], "invalid strategy='nope': allowed one of"),
    (["--strategy", "best_of_n", "--strategy.bogus", "1"], "invalid strategy.bogus='1'"),
    (["--strategy", "best_of_n", "--strategy.n"], "invalid strategy.n=None: allowed a value"),
    (["--strategy", "best_of_n", "--n", "3"], "strategy's --strategy.n"),
    (["--strategy", "best_of_n", "--temperature", "-1"], "invalid temperature=-1.0"),
    (["--strategy", "best_of_n", "--budget", "tokens=3"], "FIELD=LIMIT with FIELD one of"),
    (["--strategy", "best_of_n", "--budget", "output_tokens=-5"], "invalid budget.output_tokens='-5'"),
    (["--strategy", "best_of_n", "--budget", "output_tokens=abc"], "invalid budget.output_tokens='abc'"),
    (["--strategy", "best_of_n", "--budget", "flops=nan"], "invalid budget.flops='nan'"),
    (["--strategy", "best_of_n", "--strategy.params", "x"], "invalid strategy.params='x': allowed sampling flags"),
])
def test_cli_errors_before_loading_the_model(capsys, monkeypatch, argv, match):
    monkeypatch.setattr("metaloom.models.load", no_model)
    assert main(["run", "What is 2 + 2?", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and match in err and err.count("\n") == 1


def no_model(*args, **kwargs):
    raise AssertionError("the model was loaded before the arguments were checked")


@pytest.mark.parametrize(("argv", "error"), [
    # the prompt taken as a parameter's value: the parameter's check runs first and says so
    (["--strategy", "majority_vote", "--strategy.n", "Q"],
     "invalid strategy.n='Q': allowed a value of type int ('Q' was taken as the value of --strategy.n, "
     "so the prompt is missing)"),
    (["--strategy", "majority_vote", "--strategy.bogus", "Q"],
     "invalid strategy.bogus='Q': allowed one of ['n', 'extractor', 'inner'] "
     "('Q' was taken as the value of --strategy.bogus, so the prompt is missing)"),
    (["--strategy", "best_of_n", "--strategy.scorer", "What is 2 + 2?"],
     "invalid scorer='What is 2 + 2?': allowed one of ['countdown', 'execution', 'game24', 'judge', 'logprob', 'public_tests', "
         "'reward_model', "
     "'verifier'] "
     "('What is 2 + 2?' was taken as the value of --strategy.scorer, so the prompt is missing)"),
    # valid parameters, no prompt left
    (["--strategy", "majority_vote", "--strategy.n", "5"],
     "invalid prompt=None: allowed the text to run the strategy on, as its own argument "
     "('5' was taken as the value of --strategy.n, so the prompt is missing)"),
    (["--strategy", "majority_vote", "--strategy.n=5"],
     "invalid prompt=None: allowed the text to run the strategy on, as its own argument"),
])
def test_a_missing_prompt_is_one_error_line_naming_the_parameter(capsys, monkeypatch, argv, error):
    monkeypatch.setattr("metaloom.models.load", no_model)
    assert main(["run", *argv]) == 2
    assert capsys.readouterr().err == f"error: {error}\n"  # one line: no usage dump


def test_dotted_values_never_become_the_prompt():
    args, (params, _, _, _) = parsed("--strategy", "best_of_n", "--strategy.n", "3", "the prompt")
    assert args.prompt == "the prompt" and params == {"n": "3"}  # "3" went to n, "the prompt" to the prompt
    # a value the strategy itself refuses is caught while parsing, before any model is loaded
    with pytest.raises(InvalidParameter, match="invalid n=0"):
        parsed("--strategy", "best_of_n", "--strategy.n", "0", "the prompt")
    with pytest.raises(InvalidParameter, match="invalid n=0"):
        build_strategy("best_of_n", {"n": "0"}, {})


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
    assert out["answers"] == [LastNumber().extract(c["text"]) for c in out["candidates"]]  # the extractor named


def test_a_search_that_never_saw_its_delimiter_warns_on_stderr(capsys):
    """Its steps all ran to the step token limit: said on stderr, not only in the trace."""
    argv = ["run", "--strategy", "step_beam_search", "--strategy.n", "2", "--strategy.beam_width", "2",
            "--strategy.step_scorer", "countdown", "--strategy.delimiter", "@@never@@", "--strategy.step_tokens", "3",
            "--strategy.max_depth", "2", "--max-tokens", "6", "--seed", "0", "--json",
            "Using all the numbers 3, 5, 7, create an expression that equals 15."]
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert "no_delimiter" in [e["kind"] for e in json.loads(captured.out)["trace"]]
    assert "warning: no step ended with the delimiter" in captured.err

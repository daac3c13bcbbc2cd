"""`metaloom bench remote`: its pure pieces (problems, metrics parsing, aggregation, the table),
a strategy run on a scripted generator, and the optillm driver's protocol against a fake
optillm package — no vLLM, no model, a few seconds."""

from __future__ import annotations

import argparse
import sys
import textwrap

import pytest

from metaloom.bench.remote import rotation
from metaloom.bench.remote import systems as remote_systems
from metaloom.bench.remote.args import Options, options
from metaloom.bench.remote.metrics import COUNTERS, counter_deltas, parse_metrics
from metaloom.bench.remote.outcomes import Outcome, aggregate, usage_check
from metaloom.bench.remote.problems import SEED, SYSTEM_PROMPT, Problem, chat, make_problems
from metaloom.bench.remote.systems import Metaloom, Optillm, OptillmFailed, fanout_tokens
from metaloom.bench.remote.table import format_table
from metaloom.errors import InvalidParameter
from metaloom.meta.types import Event
from metaloom.sampling.params import SamplingParams

pytest.importorskip("reasoning_gym")


# --- problems ------------------------------------------------------------------------------------

def test_problems_are_deterministic_and_held_out_from_the_tests_seed():
    a, _ = make_problems("addition", 20, SEED)
    b, _ = make_problems("addition", 20, SEED)
    assert [(p.index, p.question, p.answer) for p in a] == [(p.index, p.question, p.answer) for p in b]
    assert len(a) == 20 and [p.index for p in a] == list(range(20))
    assert all(p.question.startswith("Calculate ") and " + " in p.question for p in a)
    other, _ = make_problems("addition", 20, 2025)  # tests/test_meta_model.py's problems
    assert [p.question for p in a] != [p.question for p in other]
    assert SEED != 2025


def test_answers_are_judged_by_reasoning_gyms_scorer():
    problems, correct = make_problems("arithmetic", 5, SEED)
    for p in problems:
        assert correct(p.answer, p)
        assert not correct(str(int(p.answer) + 1), p)
        assert not correct(None, p)


@pytest.mark.parametrize(("preset", "size"), [("nope", 3), ("addition", 0)])
def test_bad_problem_settings_are_refused(preset, size):
    with pytest.raises(InvalidParameter):
        make_problems(preset, size, 1)


def test_every_system_gets_the_same_chat():
    assert chat("Calculate 1 + 2.") == ({"role": "system", "content": SYSTEM_PROMPT},
                                        {"role": "user", "content": "Calculate 1 + 2."})


# --- metrics -------------------------------------------------------------------------------------

METRICS = textwrap.dedent("""\
    # HELP vllm:prompt_tokens_total Number of prefill tokens processed.
    # TYPE vllm:prompt_tokens_total counter
    vllm:prompt_tokens_total{engine="0",model_name="m"} 1234.0
    vllm:prompt_tokens_created{engine="0",model_name="m"} 1.7e+09
    vllm:generation_tokens_total{engine="0",model_name="m"} 50.0
    vllm:generation_tokens_total{engine="1",model_name="m"} 7.0 1700000000000
    vllm:request_success_total{engine="0",finished_reason="stop",model_name="m"} 3.0
    vllm:request_success_total{engine="0",finished_reason="length",model_name="m"} 2.0
    vllm:weird{label="a}b"} 4.0
    process_open_fds 12
    vllm:broken{engine="0"} not-a-number
    vllm:gauge_inf +Inf

    """)


def test_metrics_are_summed_over_label_sets():
    m = parse_metrics(METRICS)
    assert m["vllm:prompt_tokens_total"] == 1234.0
    assert m["vllm:generation_tokens_total"] == 57.0  # two engines; the timestamp is ignored
    assert m["vllm:request_success_total"] == 5.0  # every finish reason
    assert m["vllm:weird"] == 4.0 and m["process_open_fds"] == 12.0 and m["vllm:gauge_inf"] == float("inf")
    assert "vllm:broken" not in m and "vllm:prompt_tokens_created" in m
    assert not any(k.startswith("#") for k in m)


def test_counter_deltas():
    before = parse_metrics(METRICS)
    after = {**before, "vllm:prompt_tokens_total": 1300.0, "vllm:generation_tokens_total": 100.0,
             "vllm:prompt_tokens_cached_total": 64.0}
    assert counter_deltas(before, after) == {"generation": 43, "prompt": 66, "cached": 64, "requests": 0}
    assert set(COUNTERS) == {"generation", "prompt", "cached", "requests"}


# --- aggregation -----------------------------------------------------------------------------------

def outcome(system="metaloom-remote", strategy="majority_vote", problem=0, correct=True, seconds=1.0, inp=10, out=40,
            cached=0, server=None, error=None, sample_accuracy=0.5, fanout=0):
    return Outcome(system, strategy, problem, "4" if correct else "5", correct, seconds, inp, out, cached, 4,
                   sample_accuracy, server, error, fanout)


def test_aggregate_accuracy_tokens_seconds_and_usage_check():
    runs = [
        outcome(problem=0, seconds=1.0, server={"generation": 40, "prompt": 40, "cached": 0, "requests": 4}, fanout=30),
        outcome(problem=1, correct=False, seconds=3.0, out=50, sample_accuracy=0.25,
                server={"generation": 49, "prompt": 40, "cached": 0, "requests": 4}, fanout=30),
        outcome(problem=2, seconds=2.0, server={"generation": 40, "prompt": 40, "cached": 0, "requests": 4}, fanout=30),
        outcome(problem=3, correct=False, seconds=0.0, inp=None, out=None, error="boom"),
        outcome(system="metaloom", problem=0, seconds=5.0),
    ]
    rows = aggregate(runs)
    assert [(r["system"], r["strategy"]) for r in rows] == [("metaloom-remote", "majority_vote"), ("metaloom", "majority_vote")]
    r = rows[0]
    assert (r["problems"], r["errors"], r["first_error"]) == (4, 1, "boom")
    assert r["accuracy"] == 2 / 4  # the failed run counts as wrong
    assert r["sample_accuracy"] == pytest.approx((0.5 + 0.25 + 0.5) / 3)
    assert (r["input_tokens"], r["output_tokens"], r["cached_tokens"], r["samples"]) == (30, 130, 0, 12)
    assert (r["seconds_total"], r["seconds_median"], r["seconds_min"], r["seconds_max"]) == (6.0, 2.0, 1.0, 3.0)
    assert r["server"] == {"generation": 129, "prompt": 120, "cached": 0, "requests": 12}
    check = r["usage_check"]
    assert check["output_tokens"] == {"charged": 130, "server": 129, "fanout": 0, "runs": 3, "runs_differing": 1}
    assert check["input_tokens"] == {"charged": 30, "server": 120, "fanout": 90, "runs": 3, "runs_differing": 0}
    assert check["cached_tokens"]["runs_differing"] == 0
    local = rows[1]
    assert local["server"] is None and local["usage_check"] == {} and local["accuracy"] == 1.0


def test_unknown_token_figures_stay_unknown():
    rows = aggregate([outcome(system="optillm", inp=None, cached=None, server={"generation": 40, "prompt": 80, "cached": 0,
                                                                                "requests": 5}),
                      outcome(system="optillm", problem=1, inp=None, cached=None, out=30,
                              server={"generation": 35, "prompt": 80, "cached": 0, "requests": 5})])
    (r,) = rows
    assert r["input_tokens"] is None and r["cached_tokens"] is None and r["output_tokens"] == 70
    assert set(r["usage_check"]) == {"output_tokens"}
    assert r["usage_check"]["output_tokens"] == {"charged": 70, "server": 75, "fanout": 0, "runs": 2, "runs_differing": 1}


def test_usage_check_skips_runs_without_a_server():
    assert usage_check([outcome(server=None)]) == {}


def test_fanout_counts_the_extra_samples_prompts():
    trace = (Event("sample", {"n": 16, "round": 0, "usage": {"input_tokens": 38, "output_tokens": 900}}),
             Event("score", {"usage": {"input_tokens": 500}}),
             Event("sample", {"n": 1, "usage": {"input_tokens": 20}}))
    assert fanout_tokens(trace) == 15 * 38


def test_rotation_gives_every_system_every_place():
    systems = ["a", "b", "c"]
    orders = [rotation(systems, i) for i in range(3)]
    assert orders == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"]]
    assert rotation(systems, 4) == orders[1] and rotation([], 2) == []


def test_options_from_args_and_validation():
    assert options(argparse.Namespace()) == Options()
    o = options(argparse.Namespace(remote_problems=3, remote_n=4, remote_strategies="best_of_n"))
    assert (o.problems, o.n, o.strategies) == (3, 4, ("best_of_n",))
    for bad in ({"n": 0}, {"strategies": ("beam",)}, {"strategies": ()}, {"deadline_s": -1.0}):
        with pytest.raises(InvalidParameter):
            Options(**bad)


def test_the_table_shows_every_row_the_check_and_the_skipped():
    runs = [outcome(server={"generation": 40, "prompt": 40, "cached": 0, "requests": 4}, fanout=30),
            outcome(system="optillm", inp=None, cached=None, server={"generation": 41, "prompt": 80, "cached": 0,
                                                                      "requests": 4}),
            outcome(system="metaloom", strategy="best_of_n")]
    result = {"model": "m", "dtype": "bfloat16", "problems_run": 1, "wall_s": 12.0,
              "options": {**vars(Options()), "task": "basic_arithmetic", "strategies": list(Options().strategies)},
              "rows": aggregate(runs), "skipped": {"other": "not asked for"}, "cpus": 2,
              "loadavg_start": [1.0, 1.0, 1.0], "loadavg_end": [2.0, 2.0, 2.0]}
    text = format_table(result)
    assert "self_consistency" in text and "metaloom-remote" in text and "best_of_n" in text
    assert "80*" in text  # optillm's prompt tokens: the server's count, marked
    assert "10 +30 / 40 [0/1]" in text  # the prompt check, fan-out added
    assert "40 / 41 [1/1]" in text  # optillm's output tokens against the server's
    assert "other skipped: not asked for" in text


# --- a strategy run through the runner --------------------------------------------------------------

def test_metaloom_runner_reports_answer_ledger_and_samples():
    from metaloom.testing.scripted import ScriptedGenerator

    problems, correct = make_problems("addition", 1, SEED)
    p = problems[0]
    wrong = str(int(p.answer) + 1)
    gen = ScriptedGenerator({p.question: [f"It is {p.answer}.", f"It is {wrong}.", f"Sum: {p.answer}", "no idea"]})
    runner = Metaloom("metaloom", gen)
    params = SamplingParams(temperature=1.0, max_tokens=16, seed=1)
    vote = runner.run("majority_vote", p, 4, params, correct)
    assert (vote.answer, vote.correct, vote.samples, vote.sample_accuracy) == (p.answer, True, 4, 0.5)
    assert vote.server is None and vote.error is None and vote.output_tokens > 0
    assert vote.fanout_tokens == 3 * vote.input_tokens  # one request for 4 samples: the prompt charged once
    best = runner.run("best_of_n", p, 4, params, correct)
    assert best.samples == 4 and best.error is None and best.input_tokens > vote.input_tokens  # the judge's prompts


# --- optillm's process ---------------------------------------------------------------------------------

FAKE_SC = '''
class AdvancedSelfConsistency:
    def __init__(self, client, model, num_samples=5, similarity_threshold=0.8, request_config=None, request_id=None):
        self.n, self.self_consistency_completion_tokens = num_samples, 0
        self.max_tokens = request_config["max_tokens"]
    def evaluate(self, system_prompt, user_prompt):
        self.self_consistency_completion_tokens = 3 * self.n
        responses = ["It is 4."] * (self.n - 1) + ["It is %d." % self.max_tokens]
        return {"individual_responses": responses,
                "aggregated_result": {"clusters": [{"answer": "It is 4.", "frequency": self.n - 1}]}}
'''
FAKE_BON = '''
def best_of_n_sampling(system_prompt, initial_query, client, model, n=3, request_config=None, request_id=None):
    if "fail" in initial_query:
        raise RuntimeError("provider down")
    return "Best: 5", 7 * n
'''


def python_venv(tmp_path):
    """A 'venv' whose bin/python runs this interpreter (with this venv's packages)."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    python = venv / "bin" / "python"
    python.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    python.chmod(0o755)
    return venv


@pytest.fixture
def fake_optillm(tmp_path, monkeypatch):
    """A 'venv' whose python is this one, with a fake optillm package on its path."""
    venv = python_venv(tmp_path)
    pkg = tmp_path / "site" / "optillm"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text('__version__ = "9.9"\n')
    (pkg / "self_consistency.py").write_text(FAKE_SC)
    (pkg / "bon.py").write_text(FAKE_BON)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "site"))
    readings = iter([{"vllm:generation_tokens_total": 100.0 * i, "vllm:prompt_tokens_total": 10.0 * i} for i in range(100)])
    monkeypatch.setattr(remote_systems, "read_metrics", lambda url: next(readings))
    return str(venv)


def test_optillm_runs_through_its_driver(fake_optillm, tmp_path):
    problem = Problem(0, "Calculate 2 + 2.", "4", {})
    right = lambda answer, p: answer == p.answer  # noqa: E731
    opt = Optillm(fake_optillm, "http://127.0.0.1:1/v1", "m", str(tmp_path / "log"))
    try:
        assert opt.version == "9.9"
        sc = opt.run("majority_vote", problem, 4, SamplingParams(max_tokens=9), right)
        assert (sc.system, sc.answer, sc.correct, sc.samples, sc.sample_accuracy) == ("optillm", "4", True, 4, 0.75)
        assert (sc.output_tokens, sc.input_tokens) == (12, None)
        assert sc.server == {"generation": 100, "prompt": 10, "cached": 0, "requests": 0}
        bon = opt.run("best_of_n", problem, 4, SamplingParams(max_tokens=9), right)
        assert (bon.answer, bon.correct, bon.output_tokens, bon.samples, bon.sample_accuracy) == ("5", False, 28, None, None)
        failed = opt.run("best_of_n", Problem(1, "fail", "1", {}), 4, SamplingParams(), right)
        assert failed.error == "RuntimeError: provider down" and not failed.correct
    finally:
        opt.close()
    assert opt.proc.poll() is not None


def test_optillm_that_cannot_import_is_reported(tmp_path, monkeypatch):
    venv = python_venv(tmp_path)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "empty"))
    with pytest.raises(OptillmFailed, match="cannot import optillm: ModuleNotFoundError: No module named 'optillm'"):
        Optillm(str(venv), "http://127.0.0.1:1/v1", "m", str(tmp_path / "log"))
    with pytest.raises(OptillmFailed, match="does not exist"):
        Optillm(str(tmp_path / "nowhere"), "http://127.0.0.1:1/v1", "m", str(tmp_path / "log"))

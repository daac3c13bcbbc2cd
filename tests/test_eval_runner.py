"""`metaloom eval`'s runner: records as runs finish, resumption, configuration checks, cost
attribution of pooled samples, error records, specs, and the command line."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections import Counter

import pytest

from metaloom.cli import main
from metaloom.errors import InvalidParameter
from metaloom.eval import worker
from metaloom.eval.pool import attribute, model_row_flops
from metaloom.eval.records import RECORDS, read_records
from metaloom.eval.runner import local_executor, plan_sweep, run_sweep
from metaloom.eval.worker import Job, Outcome, Setup
from metaloom.ledger import Usage
from metaloom.meta.types import Event, Result
from metaloom.testing.scripted import Say, ScriptedGenerator
from metaloom.wiring.spec import check_spec, parse_spec

QUESTIONS = {"What is 2+3?": "5", "What is 4+4?": "8", "What is 9-2?": "7"}
# each question's scripted samples: the majority is right for the first two, wrong for the third
SCRIPT = {
    "What is 2+3?": [Say("The answer is 5.", -0.2), Say("The answer is 6.", -0.1), Say("The answer is 5.", -0.3),
                     Say("It is 5.", -0.9)],
    "What is 4+4?": [Say("The answer is 8.", -0.5), Say("The answer is 8.", -0.4), Say("The answer is 9.", -0.1),
                     Say("The answer is 8.", -0.6)],
    "What is 9-2?": [Say("The answer is 6.", -0.5), Say("The answer is 7.", -0.4), Say("The answer is 6.", -0.2),
                     Say("The answer is 7.", -0.6)],
}


def scripted() -> ScriptedGenerator:
    """The factory the sweeps below name (``Setup.factory``)."""
    return ScriptedGenerator(SCRIPT)


def failing() -> ScriptedGenerator:
    """Knows only the first question: the others raise inside the strategy."""
    return ScriptedGenerator({"What is 2+3?": SCRIPT["What is 2+3?"]})


FACTORY = f"{__name__}:scripted"


@pytest.fixture
def task_file(tmp_path):
    path = tmp_path / "questions.jsonl"
    path.write_text("".join(json.dumps({"prompt": q, "answer": a}) + "\n" for q, a in QUESTIONS.items()))
    return f"jsonl:{path}"


def setup_for(task: str, **kw) -> Setup:
    return Setup(task=task, factory=kw.pop("factory", FACTORY), **kw)


def config(out) -> dict:
    with open(os.path.join(out, "config.json")) as f:
        return json.load(f)


def lines(out) -> list[dict]:
    with open(os.path.join(out, RECORDS)) as f:
        return [json.loads(line) for line in f]


def test_sweep_writes_one_record_per_pair_graded_by_the_task(task_file, tmp_path):
    out = str(tmp_path / "sweep")
    # greedy last: the scripted generator cycles through a question's responses, and the
    # sampling strategies' draw (shared) takes all four, so greedy gets the first again
    sweep = plan_sweep(setup_for(task_file), ["majority_vote@n=4", "best_of_n@n=4,scorer=logprob", "greedy"], out)
    records = run_sweep(sweep)
    assert len(records) == 9 and len(lines(out)) == 9
    by = {(r.problem, r.strategy): r for r in records}
    ids = [p.id for p in sweep.problems]
    # greedy plays each question's first response
    assert [by[(i, "greedy")].correct for i in ids] == [True, True, False]
    # majority of 4: 5 (x3 with "It is 5."), 8 (x3), 6 vs 7 tied 2-2 -> the answer seen first, 6: wrong
    assert [by[(i, "majority_vote@n=4")].answer for i in ids] == ["5", "8", "6"]
    assert [by[(i, "majority_vote@n=4")].correct for i in ids] == [True, True, False]
    # best-of-4 by log-probability: the most likely sample wins
    assert [by[(i, "best_of_n@n=4,scorer=logprob")].answer for i in ids] == ["6", "9", "6"]
    pooled = by[(ids[0], "majority_vote@n=4")]
    assert [c.answer for c in pooled.candidates] == ["5", "6", "5", "5"]
    assert [c.correct for c in pooled.candidates] == [True, False, True, True]
    assert pooled.selection is not None and pooled.selection.kind == "majority_vote"
    assert pooled.selection.groups == (0, 1, 0, 0)
    assert [c.tokens for c in pooled.candidates] == [5, 5, 5, 4]  # words + end-of-sequence
    assert by[(ids[0], "best_of_n@n=4,scorer=logprob")].selection.kind == "best_of_n"
    # the scorer's sum of token log-probabilities (each scripted token has the response's)
    assert [c.score for c in by[(ids[0], "best_of_n@n=4,scorer=logprob")].candidates] == pytest.approx(
        [-1.0, -0.5, -1.5, -3.6])
    assert by[(ids[0], "greedy")].candidates == ()  # only sampling strategies keep their pool


def test_a_budget_in_a_spec_stops_that_strategys_runs_cleanly(task_file, tmp_path):
    # budget.FIELD=LIMIT holds a strategy to a stated cost (a search to the FLOPs of a vote)
    out = str(tmp_path / "sweep")
    spec = "adaptive_vote@max_samples=4,batch=2,budget.output_tokens=6"
    records = run_sweep(plan_sweep(setup_for(task_file), [spec, "adaptive_vote@max_samples=4,batch=2"], out))
    capped = [r for r in records if r.strategy == spec]
    free = [r for r in records if r.strategy != spec]
    assert len(capped) == 3 and all(r.stopped_reason == "budget" and r.error is None for r in capped)
    # the first batch's two rows decode side by side: the step that took them past 6 tokens
    # (the 4th: 8) was the last, and the run still chose among what it had
    assert all(r.usage["output_tokens"] == 8 and r.best for r in capped)
    assert all(r.stopped_reason != "budget" and r.usage["output_tokens"] > 10 for r in free)
    # a pooled strategy's N is its cost, and the curves read smaller N from its pool: refused
    with pytest.raises(InvalidParameter, match="no budget on a pooled strategy"):
        plan_sweep(setup_for(task_file), ["majority_vote@n=4,budget.flops=1e9"], str(tmp_path / "other"))


def test_resume_after_an_interruption_runs_only_what_is_missing(task_file, tmp_path):
    out = str(tmp_path / "sweep")
    sweep = plan_sweep(setup_for(task_file), ["greedy", "majority_vote@n=4"], out)
    ran: list[Job] = []

    def interrupted(setup, jobs, emit):
        for k, job in enumerate(jobs):
            if k == 3:
                raise KeyboardInterrupt
            ran.append(job)
            emit(worker.execute(setup, job))

    with pytest.raises(KeyboardInterrupt):
        run_sweep(sweep, executor=interrupted)
    assert len(lines(out)) == 3
    first = lines(out)

    def counting(setup, jobs, emit):
        ran.extend(jobs)
        local_executor(setup, jobs, emit)

    records = run_sweep(sweep, executor=counting)
    assert len(records) == 6 and len(lines(out)) == 6
    assert lines(out)[:3] == first  # nothing already done was redone or rewritten
    assert len(ran) == 6 and len(set(ran)) == 6  # 3 before the interruption, 3 after


def test_a_line_cut_by_a_crash_is_dropped_and_its_run_redone(task_file, tmp_path):
    out = str(tmp_path / "sweep")
    sweep = plan_sweep(setup_for(task_file), ["greedy"], out)
    run_sweep(sweep)
    path = os.path.join(out, RECORDS)
    with open(path) as f:
        text = f.read()
    cut = text[:text.rindex("\n", 0, len(text) - 1) + 1] + text.splitlines()[-1][:25]  # the last record half-written
    with open(path, "w") as f:
        f.write(cut)
    records = run_sweep(sweep)
    assert len(records) == 3 and [r["problem"] for r in lines(out)] == [p.id for p in sweep.problems]


def test_a_directory_of_another_configuration_is_refused_unless_forced(task_file, tmp_path):
    out = str(tmp_path / "sweep")
    run_sweep(plan_sweep(setup_for(task_file), ["greedy"], out))
    other = plan_sweep(setup_for(task_file, max_tokens=7), ["greedy"], out)
    with pytest.raises(InvalidParameter, match=r"--force.*max_tokens: None -> 7"):
        run_sweep(other)
    assert len(lines(out)) == 3  # untouched
    records = run_sweep(other, force=True)
    assert len(records) == 3 and len(lines(out)) == 3
    assert config(out)["setup"]["max_tokens"] == 7


def test_strategies_can_be_added_to_a_sweep(task_file, tmp_path):
    out = str(tmp_path / "sweep")
    run_sweep(plan_sweep(setup_for(task_file), ["greedy"], out))
    ran: list[Job] = []

    def counting(setup, jobs, emit):
        ran.extend(jobs)
        local_executor(setup, jobs, emit)

    records = run_sweep(plan_sweep(setup_for(task_file), ["greedy", "majority_vote@n=2"], out), executor=counting)
    assert {j.spec for j in ran} == {"majority_vote@n=2"} and len(records) == 6
    assert config(out)["strategies"] == ["greedy", "majority_vote@n=2"]


def test_a_directory_metaloom_did_not_write_is_refused(task_file, tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    with pytest.raises(InvalidParameter, match=r"no config\.json"):
        run_sweep(plan_sweep(setup_for(task_file), ["greedy"], str(out)))
    assert sorted(os.listdir(out)) == ["notes.txt"]


def test_a_run_that_fails_is_recorded_with_its_error_and_the_sweep_goes_on(task_file, tmp_path):
    out = str(tmp_path / "sweep")
    records = run_sweep(plan_sweep(setup_for(task_file, factory=f"{__name__}:failing"), ["greedy"], out))
    assert [r.error is None for r in records] == [True, False, False]
    assert "no entry for prompt" in (records[1].error or "") and not records[1].correct
    assert records[0].correct


def test_duplicate_outcomes_are_written_once(task_file, tmp_path):
    out = str(tmp_path / "sweep")
    sweep = plan_sweep(setup_for(task_file), ["greedy"], out)

    def twice(setup, jobs, emit):  # a retried job whose first attempt had in fact finished
        for job in jobs:
            outcome = worker.execute(setup, job)
            emit(outcome)
            emit(outcome)

    assert len(run_sweep(sweep, executor=twice)) == 3
    assert len(lines(out)) == 3


def test_trace_files_are_written_before_the_records_that_name_them(task_file, tmp_path):
    out = str(tmp_path / "sweep")
    sweep = plan_sweep(setup_for(task_file), ["greedy"], out)

    def with_tree(setup, jobs, emit):
        for job in jobs:
            outcome = worker.execute(setup, job)
            emit(Outcome(outcome.record, ({"kind": "tree", "nodes": [], "problem": outcome.record.problem},)))

    run_sweep(sweep, executor=with_tree)
    for r in read_records(os.path.join(out, RECORDS)):
        assert r.trace is not None
        with open(os.path.join(out, r.trace)) as f:
            assert json.load(f) == [{"kind": "tree", "nodes": [], "problem": r.problem}]


def test_pooled_costs_add_up_to_the_run_and_follow_the_flop_formula():
    class Model:  # flops linear in each argument, like LanguageModel.flops
        def flops(self, new_tokens, attended, logit_rows):
            return 100.0 * new_tokens + 1.0 * attended + 10.0 * logit_rows

    from metaloom.generator.types import Completion

    cands = tuple(Completion("x", tuple(range(k)), (0.0,) * k, "stop") for k in (2, 3))
    usage = Usage(input_tokens=4, output_tokens=5, flops=2000.0, seconds=2.0)
    result = Result(best="x", candidates=cands, usage=usage, best_index=0,
                    trace=(Event("sample", {"usage": {"input_tokens": 4, "flops": 1500.0}}),))
    costs, shared = attribute(result, model_row_flops(Model()))
    # a row of L tokens after 4 prompt tokens: its first token comes from the prefill's logits,
    # then L - 1 forwards attending 5 .. 4+L-1 keys, one logit row each
    assert costs[0][0] == 100 * 1 + 5 + 10 * 1
    assert costs[1][0] == 100 * 2 + (5 + 6) + 10 * 2
    assert shared["flops"] + costs[0][0] + costs[1][0] == pytest.approx(2000.0)
    assert sum(s for _, s in costs) + shared["seconds"] == pytest.approx(2.0)
    # without a formula (a remote server) the sampling call's FLOPs split by tokens
    costs, shared = attribute(result, None)
    assert [f for f, _ in costs] == [600.0, 900.0] and shared["flops"] == 500.0


def test_a_model_scorers_flops_are_split_over_the_candidates_it_scored():
    # best-of-N with an LLM judge: a run with fewer samples asks the judge fewer questions, so
    # the judge's FLOPs go with the candidates (by tokens), not to every subset in full
    from metaloom.generator.types import Completion

    cands = tuple(Completion("x", tuple(range(k)), (0.0,) * k, "stop") for k in (2, 3, 5))
    usage = Usage(input_tokens=4, output_tokens=10, flops=3000.0, seconds=3.0)
    result = Result(best="x", candidates=cands, usage=usage, best_index=0,
                    trace=(Event("sample", {"usage": {"input_tokens": 4, "flops": 1500.0}}),
                           Event("score", {"scorer": "judge", "usage": {"flops": 1000.0, "scorer_calls": 1}})))
    costs, shared = attribute(result, None)
    # sampling 1500 by tokens (150 a token), the judge 1000 by tokens (100 a token)
    assert [f for f, _ in costs] == pytest.approx([500.0, 750.0, 1250.0])
    assert shared["flops"] == pytest.approx(500.0)  # the rest: the prefill
    assert sum(s for _, s in costs) + shared["seconds"] == pytest.approx(3.0)


def test_specs_parse_and_check_before_any_model():
    s = parse_spec('best_of_n@n=8,scorer=judge,scorer.template="a, b"')
    assert (s.name, dict(s.params), {g: dict(p) for g, p in s.groups.items()}) == (
        "best_of_n", {"n": "8", "scorer": "judge"}, {"scorer": {"template": '"a, b"'}})
    assert parse_spec(s.text()) == s
    for bad in ("", "@n=2", "majority_vote@n", "majority_vote@n=2,n=3", "x@a=[1,2"):
        with pytest.raises(InvalidParameter):
            parse_spec(bad)
    with pytest.raises(InvalidParameter, match="one of"):
        check_spec("majority_vote@nn=2")
    with pytest.raises(InvalidParameter, match="strategy"):
        check_spec("no_such_strategy")
    with pytest.raises(InvalidParameter):
        check_spec("majority_vote@n=0")  # the strategy's own value checks run too


def test_bad_sweeps_are_refused_before_anything_is_written(task_file, tmp_path, capsys):
    out = tmp_path / "sweep"
    for argv, needle in (
        (["--task", "no_such_task", "--strategies", "greedy"], "task"),
        (["--task", task_file, "--strategies", "majority_vote@n=x"], "majority_vote@n=x"),
        (["--task", task_file, "--strategies", "greedy", "greedy"], "each spec once"),
        (["--task", task_file, "--strategies", "greedy", "--limit", "0"], "limit"),
        (["--task", task_file, "--strategies", "greedy", "--ray-address", "auto"], "executor ray"),
        (["--task", task_file, "--strategies", "greedy", "--max-tokens", "0"], "max_tokens"),
    ):
        assert main(["eval", *argv, "--out", str(out), "--no-progress"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error:") and needle in err, (argv, err)
        assert not out.exists()


def test_run_takes_a_strategy_spec(capsys):
    import argparse

    from metaloom.commands.run import Dotted, strategy_config

    ns = argparse.Namespace(strategy="majority_vote@n=3,extractor=last_number", prompt="q", dotted=[])
    params, _groups, _, _ = strategy_config(ns)
    assert (ns.strategy, params) == ("majority_vote", {"n": "3", "extractor": "last_number"})
    ns = argparse.Namespace(strategy="majority_vote@n=3", prompt="q", dotted=[Dotted("strategy", "n", "4")])
    with pytest.raises(InvalidParameter, match="already sets"):
        strategy_config(ns)


def test_setup_identity_leaves_out_the_key_and_threads():
    s = Setup(task="gsm", api_key="secret", threads=2)
    assert "api_key" not in s.identity() and "threads" not in s.identity()
    assert dataclasses.replace(s, threads=1).identity() == s.identity()


def test_sampling_strategies_share_one_pool_per_problem_and_each_is_charged_for_it(task_file, tmp_path):
    from metaloom.eval.replay import ReplayGenerator
    from metaloom.generator.types import Request
    from metaloom.ledger import Ledger
    from metaloom.sampling.params import SamplingParams

    inner = ScriptedGenerator(SCRIPT)
    draws: dict = {}
    req = Request("What is 2+3?", SamplingParams(n=4, seed=3))
    first, second = Ledger(), Ledger()
    a = ReplayGenerator(inner, draws).generate([req], ledger=first)
    b = ReplayGenerator(inner, draws).generate([req], ledger=second)
    assert a == b and len(inner.requests) == 1  # drawn once
    assert second.usage == first.usage and first.usage.output_tokens == 19  # each run pays for its draw
    # a run's later calls, and unseeded requests, always go to the model
    g = ReplayGenerator(inner, draws)
    g.generate([Request("What is 4+4?", SamplingParams(seed=1))], ledger=Ledger())
    g.generate([req], ledger=Ledger())
    ReplayGenerator(inner, draws).generate([Request("What is 2+3?", SamplingParams(n=4))], ledger=Ledger())
    assert len(inner.requests) == 4
    # in a sweep: majority vote and best-of-N at the same N draw the same samples once
    out = str(tmp_path / "sweep")
    records = run_sweep(plan_sweep(setup_for(task_file), ["majority_vote@n=4", "best_of_n@n=4,scorer=logprob"], out))
    engine = worker.worker(setup_for(task_file)).generator
    assert len(engine.requests) == 3  # one draw per problem
    by = {(r.problem, r.strategy): r for r in records}
    for pid in {r.problem for r in records}:
        mv, bon = by[(pid, "majority_vote@n=4")], by[(pid, "best_of_n@n=4,scorer=logprob")]
        assert [c.text for c in mv.candidates] == [c.text for c in bon.candidates]
        assert mv.usage["output_tokens"] == bon.usage["output_tokens"] > 0


def test_a_later_invocation_replays_the_pools_the_sweep_kept(task_file, tmp_path):
    # best-of-N added to a finished majority-vote sweep scores the very samples the vote counted
    out = str(tmp_path / "sweep")
    first = run_sweep(plan_sweep(setup_for(task_file), ["majority_vote@n=4"], out))
    assert len(os.listdir(os.path.join(out, "pools"))) == 3  # one file a problem
    worker._WORKERS.clear()  # as a new process: no pool in memory
    records = run_sweep(plan_sweep(setup_for(task_file), ["majority_vote@n=4", "best_of_n@n=4,scorer=logprob"], out))
    assert worker.worker(setup_for(task_file)).generator.requests == []  # nothing drawn again
    by = {(r.problem, r.strategy): r for r in records}
    for mv in first:
        bon = by[(mv.problem, "best_of_n@n=4,scorer=logprob")]
        assert [c.text for c in bon.candidates] == [c.text for c in mv.candidates]
        for name in ("input_tokens", "output_tokens", "forward_passes", "flops"):  # charged what the draw cost
            assert bon.usage[name] == mv.usage[name]
    # each scripted token carries its response's log-probability: the kept pool has them
    assert [c.score for c in by[(first[0].problem, "best_of_n@n=4,scorer=logprob")].candidates] == pytest.approx(
        [-1.0, -0.5, -1.5, -3.6])
    # --force starts afresh: the pools go with the records
    worker._WORKERS.clear()
    run_sweep(plan_sweep(setup_for(task_file), ["best_of_n@n=4,scorer=logprob"], out), force=True)
    assert len(worker.worker(setup_for(task_file)).generator.requests) == 3


def test_kept_pools_round_trip_every_field():
    from metaloom.eval.replay import dump, load
    from metaloom.generator.types import Completion

    draws = {"k": ([Completion("a", (1, 2), (-0.1, -math.inf), "stop", stop_reason=2, score=-1.5,
                                decoder_logprobs=(-0.2, -0.3), top_logprobs=(((1, -0.1), (5, -2.0)), ((2, -0.5),))),
                    Completion("", (), (), "length", stop_reason="\n\n", error=None)],
                   {"output_tokens": 2, "flops": 123.5, "seconds": 0.25})}
    assert load(dump(draws)) == draws


def test_only_pooled_strategies_replay_a_draw(task_file, tmp_path):
    """Two adaptive votes, majority vote and best-of-N all open with the same seeded request. A
    run that goes on after its first call must have made that call itself (a replay fills no
    prefix cache), so each adaptive vote draws; the two pooled strategies share one draw."""
    out = str(tmp_path / "sweep")
    specs = ["adaptive_vote@batch=2,max_samples=4,min_samples=2", "adaptive_vote@batch=2,max_samples=6,min_samples=2",
             "majority_vote@n=2", "best_of_n@n=2,scorer=logprob"]
    records = run_sweep(plan_sweep(setup_for(task_file), specs, out))
    assert len(records) == 3 * len(specs)
    engine = worker.worker(setup_for(task_file)).generator
    index = list(QUESTIONS)  # the sweep's seed is 0, so problem i's runs are seeded i
    opening = Counter(r.prompt for r in engine.requests if r.params.seed == index.index(r.prompt))
    assert opening == dict.fromkeys(QUESTIONS, 3)


def test_a_sweep_against_an_openai_compatible_server(tmp_path):
    from metaloom.testing.fake_openai import FakeOpenAI
    from metaloom.testing.served import serve_app

    path = tmp_path / "q.jsonl"
    path.write_text(json.dumps({"prompt": "What is 2+3?", "answer": "5"}) + "\n")
    replies = ["The answer is 5.", "The answer is 6.", "The answer is 5."]
    fake = FakeOpenAI(replies={"What is 2+3?": replies, "<|user|>What is 2+3?\n<|assistant|>": replies})
    with serve_app(fake.app) as url:
        setup = Setup(task=f"jsonl:{path}", backend="openai", base_url=url, model="fake-model")
        records = run_sweep(plan_sweep(setup, ["greedy", "majority_vote@n=3"], str(tmp_path / "out")))
    by = {r.strategy: r for r in records}
    assert by["greedy"].correct and by["majority_vote@n=3"].answer == "5"
    pooled = by["majority_vote@n=3"]
    assert [c.answer for c in pooled.candidates] == ["5", "6", "5"]
    # the server reports no FLOPs: unknown stays unknown (None), never a misleading 0
    assert pooled.usage["flops"] is None
    assert all(c.flops is None for c in pooled.candidates) and pooled.shared.get("flops") is None
    # nor any KV memory: its peak is unknown too, and so is every sample's share of it
    assert pooled.usage["kv_bytes_peak"] is None and by["greedy"].usage["kv_bytes_peak"] is None
    assert all(c.kv_bytes is None for c in pooled.candidates) and pooled.shared.get("kv_bytes_peak") is None
    assert pooled.usage["output_tokens"] == sum(c.tokens for c in pooled.candidates)
    from metaloom.eval.analysis import analyze

    analysis = analyze(records, seed=0, draws=20, bootstrap=50)
    mv = next(c for c in analysis["curves"] if c["family"] == "majority_vote")
    assert [p["flops"] for p in mv["points"]] == [None] * len(mv["points"])  # unknown, not zero
    assert [p["kv_bytes_peak"] for p in mv["points"]] == [None] * len(mv["points"])
    assert all(p["output_tokens"] > 0 for p in mv["points"])


def test_the_progress_bar_counts_runs_accuracy_tokens_and_flops(task_file, tmp_path):
    import io

    from rich.console import Console

    from metaloom.eval.progress import SweepProgress
    from metaloom.eval.records import Record

    def rec(problem, correct, tokens, flops):
        return Record(problem, "greedy", None, correct, float(correct), "", {"output_tokens": tokens, "flops": flops}, 0.1)

    buffer = io.StringIO()
    bar = SweepProgress([rec("a", True, 10, 2e12)], 4, console=Console(file=buffer, width=200, force_terminal=False))
    bar.add(rec("b", False, 30, 1e12))
    stats = bar._stats()
    bar.close()
    assert stats == "problems 2 · accuracy 50.0% · 40 tokens · 3.0 TFLOP"
    assert bar.progress.tasks[0].completed == 2 and bar.progress.tasks[0].total == 4


def test_a_second_run_into_a_folder_being_written_is_refused_naming_the_holder(task_file, tmp_path):
    """The first run holds DIR/.lock: a second one into the same --out stops before it runs a
    pair (two used to run every pair twice), saying which process holds it; after the first,
    the folder is free again and the lock file does not count as foreign content."""
    from metaloom.eval.lock import SweepLocked, sweep_lock

    out = str(tmp_path / "sweep")
    sweep = plan_sweep(setup_for(task_file), ["greedy"], out)
    with sweep_lock(out):
        with pytest.raises(SweepLocked, match=rf"pid {os.getpid()} on .*, since "):
            run_sweep(sweep)
        assert not os.path.exists(os.path.join(out, RECORDS))
    assert len(run_sweep(sweep)) == 3 and len(lines(out)) == 3
    assert len(run_sweep(plan_sweep(setup_for(task_file), ["greedy"], out))) == 3  # reopened: nothing new to run
    assert len(lines(out)) == 3

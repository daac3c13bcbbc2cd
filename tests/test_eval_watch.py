"""Watching a sweep (`metaloom report DIR --status`, `metaloom.eval.status`) and reading several
sweeps in one report (`metaloom report DIR --with OTHER`, `load.merge_sweeps`), with the report's
power-law and difficulty options."""

from __future__ import annotations

import argparse
import json
import os
import re
from dataclasses import replace

import pytest

from metaloom.errors import InvalidParameter
from metaloom.eval.lock import sweep_lock
from metaloom.eval.records import CONFIG, RECORDS
from metaloom.eval.report import build_report, load
from metaloom.eval.status import render, sweep_status
from tests.test_eval_report import BON, GREEDY, MV, PROBLEMS, STRATEGIES, make_sweep


def write_records(out, recs):
    with open(os.path.join(out, RECORDS), "w") as f:
        for r in recs:
            f.write(json.dumps(r.to_dict()) + "\n")


def test_status_counts_pairs_times_each_strategy_and_sees_the_lock(tmp_path):
    out = str(tmp_path / "sweep")
    recs = make_sweep(out)
    # half the sweep finished: p1 and p2 of every strategy; greedy took 2 s a pair, the vote 10 s
    kept = [replace(r, seconds=2.0 if r.strategy == GREEDY else 10.0) for r in recs if r.problem in ("p1", "p2")]
    write_records(out, kept)
    status = sweep_status(out)
    assert (status.done, status.planned, status.problems) == (8, 16, 4)
    rows = {r.strategy: r for r in status.rows}
    assert rows[GREEDY].done == 2 and rows[GREEDY].seconds == 2.0 and rows[GREEDY].errors == 0
    assert rows[MV].accuracy == pytest.approx(1.0)  # p1: 5 of 8 for the right answer; p2: 6 of 8
    # each strategy's own pace times its pairs left: 2 x 2 s + 3 strategies x 2 x 10 s
    assert status.seconds_left == pytest.approx(2 * 2.0 + 3 * 2 * 10.0)
    assert status.holder is None
    with sweep_lock(out):
        held = sweep_status(out)
        assert held.holder is not None and f"pid {os.getpid()}" in held.holder
        assert "running (pid" in render(held)
    # a run of greedy alone into the folder: the other strategies are planned at what they have
    with sweep_lock(out, [GREEDY]):
        only = sweep_status(out)
        assert (only.done, only.planned) == (8, 10) and only.seconds_left == pytest.approx(2 * 2.0)
    text = render(status, now=status.last_record + 65)
    assert "8/16 pairs over 4 problems, not running; last record 0:01:05 ago; time left at this pace 0:01:04" in text
    assert re.search(r"majority_vote@n=8\s+2/4\s+accuracy 100.0%\s+10.0 s a pair", text)
    with pytest.raises(InvalidParameter, match=r"config\.json missing"):
        sweep_status(str(tmp_path))


def test_the_report_command_prints_the_status_and_checks_its_flags(tmp_path, capsys):
    from metaloom.commands.report import run

    out = str(tmp_path / "sweep")
    make_sweep(out)
    args = argparse.Namespace(dir=out, output=None, screenshot=None, merge=[], difficulty="agreement", bins=3,
                              status=True, follow=None, exclude=[])
    assert run(args) == 0
    assert "16/16 pairs" in capsys.readouterr().out
    assert run(replace_ns(args, follow=0.01)) == 0  # complete: printed once, no wait
    for bad in (replace_ns(args, status=False, follow=5.0), replace_ns(args, follow=-1.0)):
        with pytest.raises(InvalidParameter, match="follow"):
            run(bad)
    with pytest.raises(InvalidParameter, match="bins"):
        run(replace_ns(args, status=False, bins=0))
    assert not os.path.exists(os.path.join(out, "report.html"))


def replace_ns(ns, **changes):
    return argparse.Namespace(**{**vars(ns), **changes})


def test_two_models_merge_into_one_report_with_their_strategies_labelled(tmp_path):
    small, large = str(tmp_path / "small"), str(tmp_path / "large")
    make_sweep(small)
    make_sweep(large)
    with open(os.path.join(large, CONFIG)) as f:
        config = json.load(f)
    config["setup"]["model"] = "/models/qwen2.5-coder-1.5b.gguf"
    with open(os.path.join(large, CONFIG), "w") as f:
        json.dump(config, f)
    merged = load.merge_sweeps([load.load_sweep(small), load.load_sweep(large)])
    specs = {r.strategy for r in merged.records}
    assert f"{MV},model=qwen2.5-coder-1.5b" in specs and "greedy@model=default" in specs
    assert len(merged.records) == 2 * 4 * len(STRATEGIES)
    assert merged.config["setup"]["model"] == "default + /models/qwen2.5-coder-1.5b.gguf"
    traced = [r for r in merged.records if r.trace]
    assert traced and all(os.path.isabs(r.trace) and os.path.exists(r.trace) for r in traced)
    page = build_report(small, merge=[large])
    # each model's vote is a curve of its own, and the equal-compute table reads each against each
    assert "majority_vote@model=qwen2.5-coder-1.5b" in page and "majority_vote@model=default" in page
    # the same model twice: the same strategies collide
    with pytest.raises(InvalidParameter, match="in two of them"):
        load.merge_sweeps([load.load_sweep(small), load.load_sweep(small)])
    config["task"] = {"name": "other"}
    with open(os.path.join(large, CONFIG), "w") as f:
        json.dump(config, f)
    with pytest.raises(InvalidParameter, match="same task"):
        load.merge_sweeps([load.load_sweep(small), load.load_sweep(large)])


def test_exclude_leaves_strategies_out_of_the_report(tmp_path):
    out = str(tmp_path / "sweep")
    make_sweep(out)
    part = load.without(load.load_sweep(out), ["best_of_n", "step_beam"])
    assert {r.strategy for r in part.records} == {GREEDY, MV}
    assert part.config["strategies"] == [GREEDY, MV]
    page = build_report(out, exclude=["best_of_n"])
    assert BON not in page and MV in page
    with pytest.raises(InvalidParameter, match="exclude"):
        load.without(load.load_sweep(out), ["@", "greedy"])


def test_the_report_shows_the_power_law_and_the_oracle_bins(tmp_path):
    out = str(tmp_path / "sweep")
    make_sweep(out)
    page = build_report(out, options={"difficulty": "pass_rate", "bins": 2})
    assert "the exponentiated power law" in page and "alt=\"coverage against samples with the fitted" in page
    assert "oracle difficulty" in page
    assert BON in page and len(PROBLEMS) == 4
    assert "compute-optimal " in page  # the paired difference under a baseline

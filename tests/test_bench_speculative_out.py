"""`metaloom bench speculative --out`: the report is rewritten after each measured method, so
a run stopped partway (a timeout, a crash) keeps every row it measured."""

from __future__ import annotations

import argparse
import json

import pytest

from metaloom.bench import speculative


def _args(tmp_path, **kw) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    speculative.add_args(p)
    args = p.parse_args(["--dtypes", "float32", "--new-tokens", "4", "--drafters", "ngram", "--peers", "", "--prompts", "free",
                         "--repeats", "1", "--prefix-tokens", "0", "--out", str(tmp_path / "spec.json")])
    return argparse.Namespace(**{**vars(args), **kw})


def test_a_run_stopped_partway_leaves_the_rows_it_measured(tmp_path, monkeypatch) -> None:
    calls = {"n": 0}

    def flaky(i: int):
        calls["n"] += 1
        if calls["n"] > len(speculative.PROMPT_SETS["free"]):  # the warm-up passes, the timed run dies
            raise RuntimeError("killed")
        return [1, 2], None

    monkeypatch.setattr(speculative, "_drafter_methods",
                        lambda *a: [speculative.Method("dies", run=flaky, peer=True)])
    with pytest.raises(RuntimeError, match="killed"):
        speculative.run(_args(tmp_path))
    with open(tmp_path / "spec.json") as f:
        report = json.load(f)
    assert report["partial"] and report["runs"][0]["partial"]
    rows = report["runs"][0]["methods"]
    assert [r["method"] for r in rows] == ["metaloom greedy"] and rows[0]["tok_s"] > 0


def test_a_finished_run_writes_the_whole_report(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(speculative, "_drafter_methods",
                        lambda *a: [speculative.Method("peer", run=lambda i: ([1, 2], None), peer=True)])
    report = speculative.run(_args(tmp_path))
    with open(tmp_path / "spec.json") as f:
        assert json.load(f) == json.loads(json.dumps(report))
    assert "partial" not in report
    assert [r["method"] for r in report["runs"][0]["methods"]] == ["metaloom greedy", "peer"]
    # every figure names the machine it ran on and the weights that ran
    from metaloom.models.kernels import isa

    assert report["cpu"] == isa.cpu_name() and report["isa"] == isa.chosen().name and report["threads"] >= 1
    assert report["weights"] == "dense" and report["runs"][0]["weights"] == "dense"

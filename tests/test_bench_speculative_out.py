"""`metaloom bench speculative --out`: the report is rewritten after each timed run, so
a run stopped partway (a timeout, a crash) keeps every row it measured."""

from __future__ import annotations

import argparse
import json

import pytest

from metaloom.bench import speculative
from metaloom.bench.speculative.methods import Method, drafter_methods
from metaloom.bench.speculative.prompts import PROMPT_SETS
from metaloom.bench.speculative.report import run_report


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
        if calls["n"] > len(PROMPT_SETS["free"]):  # the warm-up passes, the timed run dies
            raise RuntimeError("killed")
        return [1, 2], None

    monkeypatch.setattr(speculative, "drafter_methods",
                        lambda *a: [Method("dies", run=flaky, peer=True)])
    with pytest.raises(RuntimeError, match="killed"):
        speculative.run(_args(tmp_path))
    with open(tmp_path / "spec.json") as f:
        report = json.load(f)
    assert report["partial"] and report["runs"][0]["partial"]
    rows = report["runs"][0]["methods"]
    assert [r["method"] for r in rows] == ["metaloom greedy"] and rows[0]["tok_s"] > 0


def test_a_finished_run_writes_the_whole_report(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(speculative, "drafter_methods",
                        lambda *a: [Method("peer", run=lambda i: ([1, 2], None), peer=True)])
    report = speculative.run(_args(tmp_path))
    with open(tmp_path / "spec.json") as f:
        assert json.load(f) == json.loads(json.dumps(report))
    assert "partial" not in report
    assert [r["method"] for r in report["runs"][0]["methods"]] == ["metaloom greedy", "peer"]
    # every figure names the machine it ran on and the weights that ran
    from metaloom.models.kernels import isa

    assert report["cpu"] == isa.cpu_name() and report["isa"] == isa.chosen().name and report["threads"] >= 1
    # by default the weights a user gets: what `--weights auto` picks on this machine, named as it ran
    assert report["weights"] == "auto" and report["runs"][0]["weights"] in ("native", "dense")


def test_cost_model_methods_side_by_side_and_their_choices(tmp_path, smollm) -> None:
    """``--cost-model both`` measures each drafter with and without the cost model; ``auto`` has
    it always; a method's report carries what the cost model chose on each prompt."""
    from metaloom.speculative.planned import PlannedDrafter

    loaded = smollm  # the bench's prompts are text: a real tokenizer
    args = _args(tmp_path, drafters="auto,ngram@4", cost_model="both")
    skipped: dict[str, str] = {}
    methods = drafter_methods(args, loaded, 6, skipped)
    assert [m.name for m in methods] == ["metaloom auto (K<=16, cost model)", "metaloom ngram (K=4)",
                                         "metaloom ngram (K<=4, cost model)"]
    assert methods[1].planned is None and isinstance(methods[2].planned, PlannedDrafter)
    assert methods[0].planned.cost is methods[2].planned.cost  # measured once for them all
    for m in methods:
        m.tokens[0], m.ledgers[0] = m.run(0)
        m.times[0] = [1.0]
    row = run_report(loaded, methods, skipped, "float32")
    assert row["verify_cost"]["widths"][0] == 1
    auto = row["methods"][0]["cost_model"]
    assert set(auto["drafters"]) >= {"ngram", "recycling"} and auto["steps"] > 0
    per = auto["per_prompt"][0]["budget"]  # the exploration budget, summed over the prompts
    assert auto["budget"] == {"held_steps": per["held_steps"], "trimmed_nodes": per["trimmed_nodes"]}
    assert "cost_model" not in row["methods"][1]


def test_each_progress_line_reads_its_own_methods_row(tmp_path, monkeypatch, capsys) -> None:
    """From the second repeat on every method already has a row: each progress line must still
    print the one it just measured (it printed the last method's for all of them)."""
    import time

    def slow(i: int):
        time.sleep(0.02)
        return [1, 2], None

    monkeypatch.setattr(speculative, "drafter_methods", lambda *a: [Method("slow peer", run=slow, peer=True)])
    report = speculative.run(_args(tmp_path, repeats=2))
    rows = {r["method"]: r for r in report["runs"][0]["methods"]}
    lines = [x for x in capsys.readouterr().err.splitlines() if x.startswith("[float32 repeat 2/2]")]
    assert [x.split("] ")[1].split(":")[0] for x in lines] == ["metaloom greedy", "slow peer"]
    for line in lines:  # each prints its method's own row (after the last repeat: the final one)
        name, rest = line.split("] ", 1)[1].split(": ", 1)
        assert rest.startswith(f"{rows[name]['tok_s']:.2f} tok/s"), (line, rows[name]["tok_s"])
    assert f"{rows['metaloom greedy']['tok_s']:.2f}" != f"{rows['slow peer']['tok_s']:.2f}"


def test_q8_activations_reach_the_model_every_method_runs_and_the_report(tmp_path, monkeypatch) -> None:
    seen = []
    real = speculative.load

    def spy(*a, **kw):
        seen.append(kw.get("activations"))
        return real(*a, **kw)

    monkeypatch.setattr(speculative, "load", spy)
    monkeypatch.setattr(speculative, "drafter_methods", lambda *a: [])
    report = speculative.run(_args(tmp_path, activations="q8", weights="native"))
    assert seen == ["q8"] and report["activations"] == "q8"


def test_decode_only_rates_take_the_prefill_and_first_token_off() -> None:
    """Two prompts of 11 tokens each. Greedy takes 1.0 s a prompt; stopped at its first token it
    takes 0.5 s. A drafter takes 0.75 s. End to end that is 1.33x greedy. After the first token
    greedy makes 10 tokens in 0.5 s and the drafter in 0.25 s: 2x. A peer gets no decode rate."""

    def method(name: str, seconds: float, n: int = 11, peer: bool = False) -> Method:
        m = Method(name, run=lambda i: ([], None), peer=peer)
        m.times = {0: [seconds, seconds + 0.01, seconds - 0.01], 1: [seconds] * 3}  # medians: seconds
        m.tokens = {0: list(range(n)), 1: list(range(n))}
        return m

    loaded = argparse.Namespace(name="toy", weights="native")
    first = method("metaloom first token", 0.5, n=1)
    report = run_report(loaded, [method("metaloom greedy", 1.0), method("metaloom ngram", 0.75),
                                 method("llama.cpp", 0.6, peer=True)], {}, "float32", first)
    greedy, ngram, peer = report["methods"]
    assert ngram["speedup"] == pytest.approx(1.0 / 0.75)
    assert greedy["decode_tok_s"] == pytest.approx(20.0) and ngram["decode_speedup"] == pytest.approx(2.0)
    assert "decode_tok_s" not in peer and report["first_token_s"] == pytest.approx(1.0)
    without = run_report(loaded, [method("metaloom greedy", 1.0)], {}, "float32")
    assert "decode_speedup" not in without["methods"][0] and without["first_token_s"] is None


def _recording(name: str, log: list[tuple[str, int]], peer: bool = True, dies_at: int | None = None) -> Method:
    def run(i: int):
        log.append((name, i))
        if dies_at is not None and sum(1 for n, _ in log if n == name) == dies_at:
            raise RuntimeError("killed")
        return [1] * (i + 2), None  # prompt i: i + 2 tokens, so a report's token count names its prompts

    return Method(name, run=run, peer=peer)


def test_every_method_runs_a_prompt_before_any_runs_the_next_in_reverse_on_odd_repeats(tmp_path, monkeypatch) -> None:
    """A drafter is timed seconds after the greedy run it is compared with, not a whole prompt
    set later: within a repeat the methods take turns prompt by prompt, and the order flips on
    the next repeat so that a steady drift favours neither end."""
    log: list[tuple[str, int]] = []
    monkeypatch.setattr(speculative, "metaloom_method", lambda loaded, name, *a: _recording(name, log, peer=False))
    monkeypatch.setattr(speculative, "drafter_methods", lambda *a: [_recording("a", log), _recording("b", log)])
    speculative.run(_args(tmp_path, repeats=2))
    n = len(PROMPT_SETS["free"])
    warm = n * 4  # the first token, then greedy, a and b each over every prompt
    timed = log[warm:]
    first, greedy = "metaloom first token", "metaloom greedy"
    assert timed == ([(m, i) for i in range(n) for m in (first, greedy, "a", "b")]
                     + [(m, i) for i in range(n) for m in (first, "b", "a", greedy)])


def test_a_run_stopped_inside_a_prompts_turn_reports_the_prompts_every_method_ran(tmp_path, monkeypatch) -> None:
    """Partway through the first repeat the earlier methods have run one prompt more than the
    later ones: the partial report compares them all on the prompts they have all run."""
    log: list[tuple[str, int]] = []
    monkeypatch.setattr(speculative, "metaloom_method", lambda loaded, name, *a: _recording(name, log, peer=False))
    n = len(PROMPT_SETS["free"])
    monkeypatch.setattr(speculative, "drafter_methods",
                        lambda *a: [_recording("a", log), _recording("b", log, dies_at=n + 2)])
    with pytest.raises(RuntimeError, match="killed"):  # b: its warm-up, its first prompt, then dies on the second
        speculative.run(_args(tmp_path))
    assert log[-3:] == [("metaloom greedy", 1), ("a", 1), ("b", 1)]
    with open(tmp_path / "spec.json") as f:
        report = json.load(f)
    assert report["partial"]
    rows = {r["method"]: r for r in report["runs"][0]["methods"]}
    assert set(rows) == {"metaloom greedy", "a", "b"}
    assert all(r["tokens"] == 2 for r in rows.values())  # prompt 0's two tokens alone, for every method

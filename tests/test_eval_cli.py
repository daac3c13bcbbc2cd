"""`metaloom eval` and `metaloom report` end to end: --select on a scripted sweep, and the real
default model through the command line."""

from __future__ import annotations

import json
import os

import pytest

from metaloom.cli import main
from metaloom.commands.evaluate import select
from metaloom.errors import InvalidParameter
from metaloom.eval.runner import plan_sweep, run_sweep
from metaloom.eval.worker import Setup
from metaloom.testing.scripted import Say, ScriptedGenerator

# easy questions: every sample right (greedy suffices); hard ones: greedy (the first
# response) wrong, the majority of 4 right — so the cheapest right strategy differs by problem
EASY = {f"What is {i}+1?": str(i + 1) for i in range(6)}
HARD = {f"What is {i}*3?": str(3 * i) for i in range(6)}


def scripted() -> ScriptedGenerator:
    table: dict[str, list] = {q: [Say(f"The answer is {a}.")] for q, a in EASY.items()}
    for q, a in HARD.items():
        table[q] = [Say(f"The answer is {int(a) + 1}."), Say(f"The answer is {a}."), Say(f"It is {a}."),
                    Say(f"Maybe {a}.")]
    return ScriptedGenerator(table)


def test_select_prints_a_spec_run_and_the_server_accept(tmp_path):
    path = tmp_path / "q.jsonl"
    path.write_text("".join(json.dumps({"prompt": q, "answer": a}) + "\n" for q, a in {**EASY, **HARD}.items()))
    sweep = plan_sweep(Setup(task=f"jsonl:{path}", factory=f"{__name__}:scripted"),
                       ["majority_vote@n=4", "greedy"], str(tmp_path / "out"))
    records = run_sweep(sweep)
    chosen = select(records, "default", None, 0)
    # at the largest budget the best single strategy is the vote (greedy misses every hard one)
    assert chosen["strategy"].startswith("majority_vote@n=")
    assert chosen["heldout_accuracy"] == 1.0
    assert chosen["serve_model"] == chosen["strategy"] + ":default"
    assert f"--strategy '{chosen['strategy']}'" in chosen["run"]
    # with the sweep's setup, the line carries what changes the generations (it used to drop them)
    import dataclasses
    import shlex

    setup = dataclasses.replace(sweep.setup, dtype="bfloat16", weights="native", max_tokens=64)
    line = shlex.split(select(records, "default", None, 0, setup)["run"])
    assert line[:4] == ["metaloom", "run", "--strategy", chosen["strategy"]] and line[-1] == "PROMPT"
    flags = dict(zip(line[4:-1:2], line[5:-1:2], strict=True))
    assert flags == {"--model": "default", "--dtype": "bfloat16", "--weights": "native", "--max-tokens": "64"}
    import argparse

    from metaloom.commands.run import strategy_config

    ns = argparse.Namespace(strategy=chosen["strategy"], prompt="q", dotted=[])
    strategy_config(ns)  # `metaloom run` takes it as printed
    from metaloom.server.strategy import resolve_model

    call = resolve_model(chosen["serve_model"], ("default",), None)
    assert call is not None and call.name == "majority_vote"
    with pytest.raises(InvalidParameter, match="select-budget"):
        select(records, "default", 1.0, 0)  # below every strategy's cost
    # the oracle pass-rate bins are not charged: the largest budget is the vote's own 20 tokens,
    # where the agreement probe's 4 samples raise it to 40
    assert chosen["budget"] == 40.0
    oracle = select(records, "default", None, 0, difficulty="pass_rate")
    assert oracle["budget"] == 20.0 and oracle["compute_optimal_accuracy"] == 1.0


@pytest.mark.model
def test_eval_select_and_report_on_the_default_model(tmp_path, capsys, smollm):
    out = tmp_path / "sweep"
    argv = ["eval", "--task", "arithmetic", "--limit", "2", "--seed", "3", "--strategies", "greedy", "majority_vote@n=3",
            "--max-tokens", "24", "--weights", "dense", "--out", str(out), "--no-progress", "--json", "--select"]
    assert main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    assert set(result["summary"]) == {"greedy", "majority_vote@n=3"}
    assert all(s["problems"] == 2 and s["flops"] > 0 for s in result["summary"].values())
    assert result["select"]["strategy"].split("@")[0] in ("greedy", "majority_vote")
    with open(out / "records.jsonl") as f:
        records = [json.loads(line) for line in f]
    assert len(records) == 4
    pooled = next(r for r in records if r["strategy"] == "majority_vote@n=3")
    # the samples' own costs and the shared prefill add up to what the run was charged
    total = sum(c["flops"] for c in pooled["candidates"]) + pooled["shared"]["flops"]
    assert total == pytest.approx(pooled["usage"]["flops"], rel=1e-9)
    assert all(c["flops"] > 0 for c in pooled["candidates"] if c["tokens"] > 1)
    # and what no sample caused is exactly the prompt's prefill (one logit row, then forked)
    from metaloom.models.flops import attended_keys

    prompt = pooled["usage"]["input_tokens"]
    prefill = smollm.model.flops(new_tokens=prompt, attended=attended_keys([0], [prompt]), logit_rows=1)
    assert pooled["shared"]["flops"] == pytest.approx(prefill, rel=1e-9)
    # a rerun finds everything done and runs nothing
    assert main(argv) == 0
    capsys.readouterr()
    with open(out / "records.jsonl") as f:
        assert len(f.readlines()) == 4
    assert main(["report", str(out)]) == 0
    report = capsys.readouterr().out.strip()
    assert report == os.path.join(str(out), "report.html") and os.path.getsize(report) > 10_000


# no answer is ever right; greedy's answer is short where the samples' are long and the other way
# round, so which is cheaper (all-zero accuracy: the cheaper wins) depends on the selection half
WRONG = {f"What is {i}+1?": str(i + 1) for i in range(8)}


def all_wrong() -> ScriptedGenerator:
    long, short = "It is " + "very " * 12 + "unclear.", "No."
    return ScriptedGenerator({q: [Say(long if i % 2 else short)] + [Say(short if i % 2 else long)] * 3
                              for i, q in enumerate(WRONG)})


def test_select_and_the_report_pick_alike_on_an_all_zero_sweep(tmp_path, monkeypatch):
    """Issue 30: on an all-zero sweep --select printed greedy where the report's table chose
    majority_vote@n=1 (the report split the problems with seed 0, --select with the sweep's)."""
    import metaloom.eval.report.build as build
    import metaloom.eval.report.views as views

    path = tmp_path / "q.jsonl"
    path.write_text("".join(json.dumps({"prompt": q, "answer": a}) + "\n" for q, a in WRONG.items()))
    out = str(tmp_path / "out")
    sweep = plan_sweep(Setup(task=f"jsonl:{path}", factory=f"{__name__}:all_wrong", seed=6),
                       ["greedy", "majority_vote@n=4"], out)
    records = run_sweep(sweep)
    assert not any(r.correct for r in records)
    chosen = select(records, "default", None, 6)
    seen: dict = {}
    original = views.selection_view

    def keep(analysis):
        seen["view"] = original(analysis)
        return seen["view"]

    monkeypatch.setattr(views, "selection_view", keep)  # the table the page is built from
    page = build.build_report(out)
    view = seen["view"]
    # the table's row at the largest budget and the pick the report names: --select's entry
    assert view["rows"][-1]["best_single_choice"] == chosen["strategy"]
    assert view["pick"]["strategy"] == chosen["strategy"]
    assert f"<span class=\"strategy\">{chosen['strategy']}</span>" in page
    # with the sweep's seed this split makes the sampled answer the cheaper: not a tie broken by order
    assert chosen["strategy"] == "majority_vote@n=1"


def test_chat_template_args_reach_the_sweeps_model_and_its_run_line(monkeypatch):
    """`metaloom eval --chat-template-arg` built a Setup with a dict it has no field for (a
    TypeError before any run); now the variables travel as JSON text (a Setup is hashable), reach
    `load`, are part of the sweep's identity and of the `metaloom run` line --select prints."""
    import argparse
    import shlex

    from metaloom.commands.evaluate import register, run_line, setup_of
    from metaloom.eval import worker

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(["eval", "--task", "countdown", "--strategies", "greedy", "--out", "x",
                              "--chat-template-arg", "enable_thinking=false", "--chat-template-arg", "name=Bob"])
    setup = setup_of(args)
    assert json.loads(setup.chat_template_args) == {"enable_thinking": False, "name": "Bob"}
    assert hash(setup) and setup.identity()["chat_template_args"] == setup.chat_template_args
    plain = setup_of(parser.parse_args(["eval", "--task", "countdown", "--strategies", "greedy", "--out", "x"]))
    assert plain.chat_template_args is None and "chat_template_args" not in plain.identity()
    seen = _load_arguments(worker, setup, monkeypatch)
    assert seen["chat_template_args"] == {"enable_thinking": False, "name": "Bob"}
    line = shlex.split(run_line("greedy", setup))
    assert line[line.index("--chat-template-arg") + 1] == "enable_thinking=false"
    assert "name=\"Bob\"" in line


def test_q8_activations_reach_the_sweeps_model_its_identity_and_its_run_line(monkeypatch):
    """`metaloom eval --activations q8` built a Setup with a field it did not have (a TypeError
    before any run); now the setting reaches `load`, tells the sweep apart from a float one (a
    resume with the other setting is refused), and is in the `metaloom run` line."""
    import argparse
    import shlex

    from metaloom.commands.evaluate import register, run_line, setup_of
    from metaloom.eval import worker

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    base = ["eval", "--task", "countdown", "--strategies", "greedy", "--out", "x"]
    setup = setup_of(parser.parse_args([*base, "--activations", "q8"]))
    plain = setup_of(parser.parse_args(base))
    assert setup.activations == "q8" and setup.identity()["activations"] == "q8"
    assert plain.activations == "float" and "activations" not in plain.identity()  # older sweeps stay resumable
    assert _load_arguments(worker, setup, monkeypatch)["activations"] == "q8"
    line = shlex.split(run_line("greedy", setup))
    assert line[line.index("--activations") + 1] == "q8"
    assert "--activations" not in shlex.split(run_line("greedy", plain))


def _load_arguments(worker, setup, monkeypatch) -> dict:
    """The keyword arguments a `Worker` for ``setup`` passes to `load` (which is stopped there)."""
    import importlib

    seen: dict = {}

    def fake_load(model, **kwargs):
        seen.update(kwargs)
        raise RuntimeError("stop here")

    monkeypatch.setattr(importlib.import_module("metaloom.models.load"), "load", fake_load)
    with pytest.raises(RuntimeError, match="stop here"):
        worker.Worker(setup)
    return seen

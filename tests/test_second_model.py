"""A strategy's second model from text (spec_reason's ``--strategy.drafter``): the command's
loader builds it, a dry run loads nothing, a place with no loader refuses it by name."""

from __future__ import annotations

import pytest

from metaloom.errors import InvalidParameter
from metaloom.testing.scripted import ScriptedGenerator
from metaloom.wiring.configure import build_strategy


def test_the_drafter_named_as_text_is_loaded_by_the_commands_loader():
    run, small = ScriptedGenerator({}), ScriptedGenerator({})
    asked = []

    def load(model):
        asked.append(model)
        return small

    s = build_strategy("spec_reason", {"drafter": "qwen-0.5b.gguf"}, {}, {"generator": run, "load_generator": load})
    assert s.drafter is small and asked == ["qwen-0.5b.gguf"]
    assert build_strategy("spec_reason", {"drafter": "x.gguf"}, {}, {"dry": True}) is None and asked == ["qwen-0.5b.gguf"]
    assert build_strategy("spec_reason", {}, {}, {"generator": run, "load_generator": load}).drafter is None


def test_without_a_loader_a_second_model_is_refused_by_name():
    with pytest.raises(InvalidParameter, match="second model") as err:
        build_strategy("spec_reason", {"drafter": "x.gguf"}, {}, {"generator": ScriptedGenerator({})})
    assert err.value.name == "strategy.drafter"


def test_a_model_being_run_is_still_not_settable():
    with pytest.raises(InvalidParameter, match="model being run") as err:
        build_strategy("best_of_n", {"scorer": "judge"}, {"scorer": {"generator": "x"}},
                       {"generator": ScriptedGenerator({}), "load_generator": lambda m: None})
    assert err.value.name == "scorer.generator"


def test_metaloom_run_loads_the_drafter_named_on_the_command_line(capsys, monkeypatch):
    import json

    from metaloom.cli import main

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main(["run", "What is 2+3?", "--strategy", "spec_reason", "--strategy.drafter", "default",
                 "--strategy.max_steps", "1", "--max-tokens", "8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    steps = [e for e in out["trace"] if e["kind"] == "step"]
    models = next(e for e in out["trace"] if e["kind"] == "models")
    assert len(steps) == 1 and steps[0]["writer"] in ("small", "large")
    assert models["small"]["output_tokens"] > 0  # the drafter drafted

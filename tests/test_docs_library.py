"""docs/library.md is a walk-through that runs: its python blocks, in order, in one namespace, on
the default model (loaded once for the session; `load` in the page returns it)."""

from __future__ import annotations

import pathlib
import re

import pytest

PAGE = pathlib.Path(__file__).resolve().parent.parent / "docs" / "library.md"


def blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", PAGE.read_text(encoding="utf-8"), flags=re.DOTALL)


def test_the_page_shows_the_strategies_a_search_and_the_keyword_only_ledger() -> None:
    code = "\n".join(blocks())
    assert len(blocks()) >= 3
    for shown in ("MajorityVote", "StepBeamSearch", "CountdownSteps", "CountdownAnswer", "Raw(", "Budget("):
        assert shown in code, shown
    # every run passes its ledger by keyword (run's ledger is keyword-only)
    runs = re.findall(r"\.run\(([^\n]*)", code)
    assert runs and all("ledger=" in r for r in runs)


@pytest.mark.model
def test_the_library_page_runs(smollm, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr("metaloom.models.load", lambda *args, **kwargs: smollm)
    namespace: dict[str, object] = {}
    for k, block in enumerate(blocks()):
        exec(compile(block, f"{PAGE.name} block {k + 1}", "exec"), namespace)
    printed = capsys.readouterr().out
    assert printed.count("\n") >= 8
    chat, raw, found, tree = (namespace[name] for name in ("chat", "raw", "found", "tree"))
    # a plain str is a chat prompt: the instruct model answers (bare text made it answer nothing)
    assert all(c.text.strip() for c in chat.candidates)  # type: ignore[attr-defined]
    assert raw.usage.input_tokens < chat.usage.input_tokens  # type: ignore[attr-defined]  # no template around it
    assert len(tree["nodes"]) > 1 and found.usage.output_tokens > 0  # type: ignore[index, attr-defined]

"""The tool_chain strategy (ReAct): golden runs on the scripted generator (a call then an answer,
a failing tool, the step limit, budget stops, trace and ledger), its grammar on the real
llguidance, and one step of the real default model parsed under it."""

import dataclasses
import json
import time
from typing import ClassVar

import pytest

from metaloom.constrain.spec import ConstraintSpec
from metaloom.errors import InvalidParameter, Unsupported
from metaloom.ledger import Budget, Ledger
from metaloom.meta.tool_chain import FORCE, FORCED_GRAMMAR, INSTRUCTIONS, ToolChain, describe, grammar, parse_step
from metaloom.sampling.params import SamplingParams
from metaloom.score.answers import LastNumber
from metaloom.score.prompting import fill
from metaloom.testing.scripted import CAPABILITIES, ScriptedGenerator, count_tokens
from metaloom.tools import TOOLS, ToolSettings, make_tools
from metaloom.wiring.configure import build_strategy

Q = "What is 37 * 43 + 12?"
CALL = 'Thought: I should compute it.\nAction: calculator\nAction Input: {"expression": "37 * 43 + 12"}'
FINAL = "Thought: I now know the final answer\nFinal Answer: 1603"


class LarkScripted(ScriptedGenerator):
    """Plays its table whatever the constraint (the real grammar is tested on the real model)."""

    capabilities = dataclasses.replace(CAPABILITIES, constraints=frozenset({"lark"}))


def base(tools=("calculator",), question=Q, settings=None):
    made = make_tools(tools, settings or ToolSettings())
    return fill(INSTRUCTIONS, "template", tools=describe(made), names=", ".join(tools), prompt=question)


class Boom:
    name, description = "boom", "always fails"
    schema: ClassVar = {"type": "object", "properties": {"x": {"type": "string"}}, "required": ["x"],
                        "additionalProperties": False}

    def call(self, arguments):
        raise RuntimeError("the tool broke")


class Slow:
    name, description = "slow", "takes a while"
    schema: ClassVar = {"type": "object", "properties": {}, "additionalProperties": False}

    def call(self, arguments):
        time.sleep(0.2)
        return "done"


def test_a_tool_call_then_a_final_answer():
    b = base()
    observed = f"{CALL}\nObservation: 1603\n"
    g = LarkScripted({b: [CALL], b + observed: [FINAL]})
    ledger = Ledger()
    r = ToolChain(tools=("calculator",), extractor=LastNumber()).run(Q, g, ledger=ledger)
    assert r.best == "1603" and r.stopped_reason is None and r.answer == "1603"
    assert [c.text for c in r.candidates] == [CALL, FINAL] and r.best_index == 1 and r.answers == (None, "1603")
    assert [e.kind for e in r.trace] == ["step", "tool", "step", "final_answer", "tree"]
    tool = r.trace[1].data
    assert (tool["tool"], tool["arguments"], tool["observation"], tool["ok"]) == ("calculator", {"expression": "37 * 43 + 12"},
                                                                                  "1603", True)
    assert r.trace[3].data == {"answer": "1603", "forced": False}
    # every step is one request under the step grammar, greedy, no stop strings (the grammar ends it)
    assert [req.prompt for req in g.requests] == [b, b + observed]
    assert all(req.constraint == ConstraintSpec.lark(grammar(make_tools(["calculator"], ToolSettings())))
               for req in g.requests)
    assert all(req.params.temperature == 0.0 and req.params.stop == () and req.params.max_tokens == 256 for req in g.requests)
    # the ledger: two model calls (prompt tokens, one output token per word plus the end), tool time as seconds
    words = count_tokens(CALL) + count_tokens(FINAL) + 2
    assert r.usage.output_tokens == words and r.usage.input_tokens == count_tokens(b) + count_tokens(b + observed)
    assert r.usage.seconds == pytest.approx(tool["seconds"]) and tool["seconds"] > 0
    assert ledger.usage == r.usage
    assert r.trace[0].data["usage"]["output_tokens"] == count_tokens(CALL) + 1


def test_the_answer_without_an_extractor_and_the_chain_as_a_tree(capsys, tmp_path):
    """No extractor: the result's answer is the final answer as written (it was null beside
    best); the trace's tree event is the chain, which `metaloom tree` draws (it refused the file)."""
    import json

    from metaloom.cli import main
    from metaloom.search.trace import parse_trees

    b = base()
    g = LarkScripted({b: [CALL], b + f"{CALL}\nObservation: 1603\n": [FINAL]})
    r = ToolChain(tools=("calculator",)).run(Q, g, ledger=Ledger())
    assert (r.best, r.answer, r.answers) == ("1603", "1603", (None, "1603"))
    result = json.dumps({"strategy": "tool_chain", **r.to_dict()})
    assert json.loads(result)["answer"] == "1603"
    (record,) = parse_trees(result, "result.json")
    tree = record.tree
    assert [(n["id"], n["parent"], n["state"]) for n in tree["nodes"]] == [(0, None, "root"), (1, 0, "expanded"),
                                                                          (2, 1, "finished")]
    assert tree["nodes"][1]["tool"] == "calculator" and tree["nodes"][1]["observation"] == "1603"
    assert tree["nodes"][2]["answer"] == "1603" and tree["best"] == 2 and tree["stop"] == "finished"
    assert [round_["usage"] for round_ in tree["rounds"]] == [e.data["usage"] for e in r.trace if e.kind == "step"]
    path = tmp_path / "result.json"
    path.write_text(result)
    assert main(["tree", str(path), "--no-color"]) == 0
    out = capsys.readouterr().out
    assert "tool_chain" in out and "stop finished" in out


def test_a_tool_that_raises_is_an_observation_and_the_run_goes_on(monkeypatch):
    monkeypatch.setitem(TOOLS, "boom", lambda settings: Boom())
    b = base(("boom",))
    call = 'Thought: try it\nAction: boom\nAction Input: {"x": "1"}'
    observed = f"{call}\nObservation: Error: RuntimeError: the tool broke\n"
    g = LarkScripted({b: [call], b + observed: ["Thought: it failed\nFinal Answer: unknown"]})
    r = ToolChain(tools=("boom",)).run(Q, g, ledger=Ledger())
    assert r.best == "unknown" and r.stopped_reason is None
    assert r.trace[1].kind == "tool" and r.trace[1].data["ok"] is False
    assert r.trace[1].data["observation"] == "Error: RuntimeError: the tool broke"
    assert g.requests[1].prompt == b + observed


def test_bad_steps_are_observations_too():
    b = base()
    unknown = 'Thought: hm\nAction: browser\nAction Input: {"url": "x"}'
    o1 = f"{unknown}\nObservation: Error: unknown tool 'browser'; tools: calculator\n"
    refused = 'Thought: hm\nAction: calculator\nAction Input: {"expression": "import os"}'
    o2 = f"{refused}\nObservation: Error: not an expression: 'import os'\n"
    g = LarkScripted({b: [unknown], b + o1: [refused], b + o1 + o2: [FINAL]})
    r = ToolChain(tools=("calculator",)).run(Q, g, ledger=Ledger())
    assert r.best == "1603" and [e.data["ok"] for e in r.trace if e.kind == "tool"] == [False, False]


def test_the_step_limit_forces_an_answer():
    b = base()
    observed = f"{CALL}\nObservation: 1603\n"
    g = LarkScripted({b: [CALL], b + observed: [CALL], b + observed * 2 + FORCE: [" 1603"]})
    r = ToolChain(tools=("calculator",), max_steps=2).run(Q, g, ledger=Ledger())
    assert r.best == "1603" and r.best_index == 2 and len(r.candidates) == 3
    assert [e.kind for e in r.trace] == ["step", "tool", "step", "tool", "step_limit", "answer", "final_answer", "tree"]
    assert r.trace[-2].data == {"answer": "1603", "forced": True}
    assert g.requests[-1].constraint == ConstraintSpec.lark(FORCED_GRAMMAR)
    # without forcing: no answer, nothing chosen, and it says why
    g = LarkScripted({b: [CALL], b + observed: [CALL]})
    r = ToolChain(tools=("calculator",), max_steps=2, force_answer=False).run(Q, g, ledger=Ledger())
    assert (r.best, r.best_index, r.trace[-2].kind) == ("", None, "step_limit") and len(g.requests) == 2
    assert r.trace[-1].data["stop"] == "step_limit" and r.trace[-1].data["best"] is None


def test_a_budget_stop_keeps_what_was_done():
    b = base()
    g = LarkScripted({b: [CALL], b + f"{CALL}\nObservation: 1603\n": [FINAL]})
    limit = count_tokens(CALL) + 4  # inside the second step
    r = ToolChain(tools=("calculator",)).run(Q, g, ledger=Ledger(budget=Budget(output_tokens=limit)))
    assert r.stopped_reason == "budget" and r.best_index is None
    assert [c.finish_reason for c in r.candidates] == ["stop", "budget"]
    assert [e.kind for e in r.trace] == ["step", "tool", "step", "budget", "tree"]
    assert r.trace[-2].data["field"] == "output_tokens" and r.usage.output_tokens == limit + 1
    tree = r.trace[-1].data  # the chain so far: the budget cut the second step
    assert tree["stop"] == "budget" and [n["state"] for n in tree["nodes"]] == ["root", "expanded", "open"]


def test_tool_time_is_charged_and_a_seconds_budget_stops_after_the_call(monkeypatch):
    monkeypatch.setitem(TOOLS, "slow", lambda settings: Slow())
    b = base(("slow",))
    call = "Thought: wait\nAction: slow\nAction Input: {}"
    g = LarkScripted({b: [call], b + f"{call}\nObservation: done\n": [FINAL]})
    r = ToolChain(tools=("slow",)).run(Q, g, ledger=Ledger(budget=Budget(seconds=0.1)))
    assert r.stopped_reason == "budget" and [e.kind for e in r.trace] == ["step", "tool", "budget", "tree"]
    assert r.trace[1].data["observation"] == "done" and r.usage.seconds >= 0.2 and len(g.requests) == 1


def test_unconstrained_steps_stop_at_the_observation():
    b = base()
    rambling = CALL + "\nObservation: 999 (made up)"
    g = ScriptedGenerator({b: [rambling], b + f"{CALL}\nObservation: 1603\n": [FINAL]})
    r = ToolChain(tools=("calculator",), constrained=False).run(Q, g, ledger=Ledger())
    assert r.best == "1603" and all(req.constraint is None for req in g.requests)
    assert g.requests[0].params.stop == ("\nObservation:",)
    # the scripted generator serves no grammar: asking for one is a typed refusal, not a silent free run
    with pytest.raises(Unsupported, match="lark"):
        ToolChain(tools=("calculator",)).run(Q, ScriptedGenerator({b: [CALL]}), ledger=Ledger())


def test_parse_step():
    s = parse_step(CALL)
    assert (s.thought, s.action, s.arguments, s.final, s.error) == ("I should compute it.", "calculator",
                                                                    {"expression": "37 * 43 + 12"}, None, None)
    assert parse_step(FINAL).final == "1603"
    trailing = parse_step('Thought: x\nAction: calculator\nAction Input: {"expression": "1"} and more')
    assert trailing.arguments == {"expression": "1"}
    assert "not JSON" in parse_step("Thought: x\nAction: calculator\nAction Input: {oops").error
    assert "a JSON object" in parse_step("Thought: x\nAction: calculator\nAction Input: 1 +").error
    assert "expected 'Thought" in parse_step("The answer is 4").error


def test_parameters_are_validated(tmp_path):
    for bad in [dict(tools=()), dict(tools=("browser",)), dict(tools=("calculator", "calculator")),
                dict(tools=("search",)), dict(corpus="x.txt"), dict(max_steps=0), dict(top_k=0),
                dict(tool_timeout_s=0), dict(max_observation_chars=0), dict(template="no question"),
                dict(template="{oops}"), dict(constrained="yes"), dict(extractor=LastNumber)]:
        with pytest.raises(InvalidParameter):
            ToolChain(**bad)
    with pytest.raises(InvalidParameter, match="corpus"):  # the file is read when the tools are built
        ToolChain(tools=("search",), corpus=str(tmp_path / "missing.txt")).run(Q, LarkScripted({}), ledger=Ledger())


def test_built_from_cli_text(tmp_path):
    corpus = tmp_path / "c.txt"
    corpus.write_text("Paris is the capital of France.\n")
    s = build_strategy("tool_chain", {"tools": "calculator,search", "corpus": str(corpus), "max_steps": "3"})
    assert s == ToolChain(tools=("calculator", "search"), corpus=str(corpus), max_steps=3)


def test_the_grammar_compiles_on_llguidance_and_accepts_exactly_steps(tmp_path):
    from metaloom.constrain.vocab import llguidance

    llg = llguidance()
    corpus = tmp_path / "c.txt"
    corpus.write_text("doc one\n")
    tools = make_tools(["calculator", "python", "search"], ToolSettings(corpus=str(corpus)))
    text = json.dumps({"grammars": [{"lark_grammar": grammar(tools)}]})
    is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(text)
    assert not is_error, messages
    forced = json.dumps({"grammars": [{"lark_grammar": FORCED_GRAMMAR}]})
    assert not llg.LLMatcher.validate_grammar_with_warnings(forced)[0]


def test_one_step_of_the_default_model_parses_under_the_grammar(smollm_generator):
    chain = ToolChain(tools=("calculator",), max_steps=1, force_answer=False,
                      params=SamplingParams(temperature=0.0, max_tokens=64))
    r = chain.run(({"role": "user", "content": "What is 37 * 43?"},), smollm_generator, ledger=Ledger())
    step = r.candidates[0]
    assert step.finish_reason == "stop", step.text  # the grammar ended it, within 64 tokens
    parsed = parse_step(step.text)
    assert parsed.error is None and (parsed.final is not None or parsed.action == "calculator"), step.text
    if parsed.action is not None:  # JSON valid for the calculator's schema
        assert set(parsed.arguments) == {"expression"} and isinstance(parsed.arguments["expression"], str)
        assert r.trace[1].kind == "tool"
    assert r.usage.output_tokens == len(step.token_ids)


def test_a_thought_cannot_hold_the_answer_and_ends_within_its_token_bound(smollm_generator):
    """Qwen2.5-Coder-0.5B wrote "Thought: ... Final Answer: 436.0.0.0..." on one line until
    max_tokens. The thought line now excludes the step markers, and is at most THOUGHT_TOKENS
    tokens: then the line must end (a bound on characters beside the negation made
    llguidance's lexer give up after about 80 characters, so the bound is on tokens)."""
    from metaloom.constrain.grammar import compile_constraint
    from metaloom.meta.tool_chain import THOUGHT_TOKENS

    vocab = smollm_generator.vocabulary
    spec = ConstraintSpec.lark(grammar(make_tools(["calculator"], ToolSettings())))
    newline = vocab.ll.tokenize_str("\n")[0]
    cursor = compile_constraint(spec, vocab).cursor()
    for t in vocab.ll.tokenize_str("Thought: " + "The total is 436. I now know the final answer. " * 3 + "Final Answe"):
        cursor.advance(t)
    mask = cursor.mask()
    last = vocab.ll.tokenize_str("r")  # "Final Answer" may not be completed inside the thought
    assert len(last) == 1 and not bool(mask[last[0]]) and bool(mask[newline])
    assert not any(bool(mask[e]) for e in vocab.eos)
    cursor = compile_constraint(spec, vocab).cursor()
    for t in vocab.ll.tokenize_str("Thought: ") + vocab.ll.tokenize_str(" 0.") * THOUGHT_TOKENS:
        if not bool(cursor.mask()[t]):
            break
        cursor.advance(t)
    allowed = cursor.mask().nonzero().flatten().tolist()
    assert allowed and all(vocab.ll.decode_str([a]).startswith("\n") for a in allowed)


def test_the_chain_runs_unchanged_through_metaloom_serve(smollm, smollm_generator):
    """--backend openai: the same steps (the grammar travels as guided_grammar), tool calls and
    answer through `RemoteGenerator` against `metaloom serve` as on the local engine."""
    from metaloom.generator import LocalGenerator
    from metaloom.generator.remote import RemoteGenerator
    from metaloom.server.app import create_app
    from metaloom.testing.served import serve_app

    chain = ToolChain(tools=("calculator",), max_steps=2, params=SamplingParams(temperature=0.0, max_tokens=48))
    prompt = ({"role": "user", "content": "What is 37 * 43?"},)
    mine = chain.run(prompt, smollm_generator, ledger=Ledger())
    with serve_app(create_app(LocalGenerator(smollm), model_ids=["default"])) as url, \
            RemoteGenerator(url, "default") as remote:
        theirs = chain.run(prompt, remote, ledger=Ledger())
    assert [e.kind for e in theirs.trace] == [e.kind for e in mine.trace]
    assert [c.text for c in theirs.candidates] == [c.text for c in mine.candidates]
    assert theirs.best == mine.best and theirs.usage.output_tokens == mine.usage.output_tokens

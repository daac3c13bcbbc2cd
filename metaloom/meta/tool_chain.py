"""Tool use: think, call a tool, read what it returned, repeat — until a final answer or the
step limit (Yao et al. 2023, "ReAct: Synergizing Reasoning and Acting in Language Models";
Press et al. 2023, Self-Ask; Gao et al. 2023, PAL, for the python tool).

The model continues one text transcript. Each step is one `Generator.generate` call whose
output is constrained by a Lark grammar (llguidance's dialect, `grammar`) to exactly

    Thought: <one line>
    Action: <a tool's name>
    Action Input: <JSON valid for that tool's schema>

or ``Thought: <one line>\\nFinal Answer: <one line>``. The tool runs (`metaloom.tools.call_tool`:
an exception or a timeout becomes an ``Error: ...`` observation, never a crash), and
``Observation: <result>`` is appended before the next step. A chat prompt is rendered once
through the generator's chat template (`Generator.render`) and continued as raw text, as in
budget forcing. ``constrained=False`` sends no grammar (for servers without Lark support)
and parses what comes back leniently, stopping each step at ``"\\nObservation:"``.

Accounting: the steps are model calls on the run's ledger. Tools are charged as wall time
(`Usage.seconds`, as scorers charge theirs), so a ``seconds`` budget bounds them too; the
ledger has no field counting tool calls, so each call, with its own seconds, is a "tool"
event in the trace.

The result's ``answer`` is the final answer (extracted by ``extractor`` when one is given, else
as the model wrote it), and the trace ends with a "tree" event: the chain of steps as a path
(each step a node, its tool and observation beside it, each step's cost a round), so
``metaloom tree`` draws a tool chain as it draws a search.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from metaloom.constrain.spec import ConstraintSpec
from metaloom.errors import BudgetExceeded
from metaloom.generator.types import Completion, Generator, Request, render
from metaloom.ledger import Ledger
from metaloom.meta.helpers import (
    Run,
    budget_event,
    component,
    ensure,
    extract_all,
    guarded,
    positive,
    stop_if_budget,
    with_user_text,
)
from metaloom.meta.types import Result
from metaloom.sampling.params import SamplingParams
from metaloom.score.answers import Extractor
from metaloom.score.prompting import fill, user_text
from metaloom.score.protocols import Prompt, as_chat
from metaloom.tools import TOOLS, Observation, Tool, ToolSettings, call_tool, make_tools

INSTRUCTIONS = """Answer the question. You can use these tools:
{tools}

Use exactly this format:
Thought: what to do next, on one line
Action: one of {names}
Action Input: the tool's arguments as JSON
Observation: what the tool returned
... (Thought, Action, Action Input and Observation repeat as needed)
Thought: I now know the final answer
Final Answer: the answer, on one line

Question: {prompt}"""
FORCE = "Thought: I must answer now.\nFinal Answer:"  # appended at the step limit
# JSON as the engine's JSON Schema compiler writes it by default here: compact, no free whitespace
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_STEP = re.compile(r"Thought:[ \t]*(?P<thought>[^\n]*)\n(?:Action:[ \t]*(?P<action>[^\n]*?)[ \t]*\nAction Input:[ \t]*"
                   r"(?P<input>.*)|Final Answer:[ \t]*(?P<final>[^\n]*))", re.S)


def _greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=256)  # per step


def describe(tools: Iterable[Tool]) -> str:
    """One line per tool: name, description, argument schema."""
    return "\n".join(f"- {t.name}: {t.description} Arguments: {json.dumps(dict(t.schema))}" for t in tools)


def grammar(tools: Sequence[Tool]) -> str:
    """The Lark grammar (llguidance dialect) of one step: a thought, then a call of one of
    ``tools`` with JSON arguments valid for its schema (``%json``), or a final answer."""
    calls = []
    rules = []
    for i, t in enumerate(tools):
        schema = {**t.schema, "x-guidance": JSON_STYLE}
        calls.append(f"call{i}")
        rules.append(f"call{i}: {json.dumps(f'Action: {t.name}' + chr(10) + 'Action Input: ')} args{i}\n"
                     f"args{i}: %json {json.dumps(schema)}")
    action = " | ".join([*calls, "final"])
    # a thought is one line that cannot itself hold the answer or an action (a small model
    # otherwise writes "Final Answer: ..." inside its thought and never ends the line; a bound
    # on its characters beside the negation blows up llguidance's lexer, "too many
    # expressions", so the bound is on tokens); the answer is one line of bounded tokens too
    return "\n".join([f'start: "Thought: " thought "\\n" ({action})', *rules,
                      f"thought[max_tokens={THOUGHT_TOKENS}]: THOUGHT",
                      'final: "Final Answer: " answer "\\n"?', f"answer[max_tokens={ANSWER_TOKENS}]: LINE",
                      THOUGHT, LINE, ""])


THOUGHT = r"THOUGHT: /[^\n]+/ & ~/.*(Final Answer|Action:|Observation:).*/"
LINE = r"LINE: /[^\n]+/"
# a small model that loops inside a line ("436.0.0.0...") is stopped there: the line must end
THOUGHT_TOKENS, ANSWER_TOKENS = 80, 40
FORCED_GRAMMAR = f'start: " " answer "\\n"?\nanswer[max_tokens={ANSWER_TOKENS}]: LINE\n{LINE}\n'


@dataclass(frozen=True)
class Step:
    """A parsed step: a tool call (``action`` and ``arguments``) or a ``final`` answer; ``error``
    says why a text could not be read as either."""

    thought: str = ""
    action: str | None = None
    arguments: Any = None
    final: str | None = None
    error: str | None = None


def parse_step(text: str) -> Step:
    """Read one step's text (grammar-constrained or free)."""
    m = _STEP.search(text)
    if m is None:
        return Step(error="expected 'Thought: ...' then 'Action: ...' and 'Action Input: ...', or 'Final Answer: ...'")
    thought = m["thought"].strip()
    if m["final"] is not None:
        return Step(thought, final=m["final"].strip())
    raw = m["input"].strip()
    try:
        arguments, _ = json.JSONDecoder().raw_decode(raw)  # a free step may go on after the JSON
    except json.JSONDecodeError as exc:
        return Step(thought, m["action"], error=f"Action Input is not JSON ({exc.msg}): {raw[:200]!r}")
    if not isinstance(arguments, dict):
        return Step(thought, m["action"], error=f"Action Input must be a JSON object, not {raw[:200]!r}")
    return Step(thought, m["action"], arguments)


def observe(step: Step, tools: Mapping[str, Tool], timeout_s: float) -> Observation:
    """What the model is told after ``step``: the tool's result or an error."""
    if step.error is not None:
        return Observation(f"Error: {step.error}", False, 0.0)
    if step.action is None or step.action not in tools:
        return Observation(f"Error: unknown tool {step.action!r}; tools: {', '.join(tools)}", False, 0.0)
    return call_tool(tools[step.action], step.arguments, timeout_s)


def clip(text: str, limit: int) -> str:
    text = text.strip()
    return text if len(text) <= limit else text[:limit] + f"... [{len(text) - limit} more characters]"


@dataclass(frozen=True)
class ToolChain:
    """ReAct: think, call a tool (calculator, python, search, ...), observe, repeat; then answer.

    ``tools`` are names from `metaloom.tools.TOOLS`; ``corpus`` is the text or JSONL file the
    ``search`` tool retrieves from (``top_k`` documents a query). At most ``max_steps`` steps of
    ``params.max_tokens`` tokens each; at the limit, with ``force_answer``, one more call asks
    for the final answer. ``tool_timeout_s`` bounds each tool call; an observation longer than
    ``max_observation_chars`` is cut. ``template`` uses ``{tools}``, ``{names}`` and ``{prompt}``.
    The chosen output is the final answer; the candidates are the steps."""

    tools: tuple[str, ...] = ("calculator", "python")
    max_steps: int = 6
    corpus: str | None = None
    top_k: int = 3
    tool_timeout_s: float = 10.0
    max_observation_chars: int = 2000
    constrained: bool = True
    force_answer: bool = True
    template: str = INSTRUCTIONS
    params: SamplingParams = field(default_factory=_greedy)
    extractor: Extractor | None = None

    def __post_init__(self) -> None:
        names = self.tools
        ensure(isinstance(names, tuple | list) and len(names) >= 1 and all(n in TOOLS for n in names)
               and len(set(names)) == len(names), "tools", names, f"distinct names from {sorted(TOOLS)}")
        ensure(("search" in names) == (self.corpus is not None), "corpus", self.corpus,
               "a text or JSONL file, one document a line, exactly when the search tool is used")
        positive("max_steps", self.max_steps)
        positive("max_observation_chars", self.max_observation_chars)
        ToolSettings(self.corpus, self.top_k, self.tool_timeout_s)  # top_k, tool_timeout_s
        for name in ("constrained", "force_answer"):
            ensure(isinstance(getattr(self, name), bool), name, getattr(self, name), "true or false")
        ensure(isinstance(self.template, str), "template", self.template, "a template string")
        filled = [fill(self.template, "template", tools=v, names=v, prompt=v) for v in ("", "x")]
        ensure(filled[0] != filled[1], "template", self.template, "a template using {prompt}")
        ensure(isinstance(self.params, SamplingParams), "params", self.params, "a SamplingParams")
        component("extractor", self.extractor, Extractor, "None or an Extractor instance", optional=True)

    def run(self, prompt: Prompt, generator: Generator, *, ledger: Ledger) -> Result:
        prompt = as_chat(prompt)  # a plain str is the user's message (`Raw` for none)
        # tools are built before any model call: a missing corpus or sandbox is a typed error here
        tools = {t.name: t for t in make_tools(self.tools, ToolSettings(self.corpus, self.top_k, self.tool_timeout_s))}
        text = fill(self.template, "template", tools=describe(tools.values()), names=", ".join(tools),
                    prompt=user_text(prompt))
        base = render(generator, with_user_text(prompt, text))
        step_grammar = ConstraintSpec.lark(grammar(list(tools.values()))) if self.constrained else None

        def body(run: Run) -> None:
            stop = "step_limit"
            try:
                steps(run)
            except BudgetExceeded as exc:
                budget_event(run, exc)  # before the tree, as a search records it
                stop = "budget"
                raise
            finally:  # a budget stop too: the chain so far, drawn by `metaloom tree`
                run.event("tree", **chain_tree(run, stop))

        def steps(run: Run) -> None:
            transcript = ""
            for i in range(1, self.max_steps + 1):
                c = self._call(run, generator, base + transcript, step_grammar, ("\nObservation:",), "step", index=i)
                step = parse_step(c.text)
                if step.final is not None and step.error is None:
                    self._finish(run, step.final, forced=False)
                    return
                seen = observe(step, tools, self.tool_timeout_s)
                obs = clip(seen.text, self.max_observation_chars)
                run.event("tool", step=i, tool=step.action, arguments=step.arguments, ok=seen.ok,
                          seconds=seen.seconds, observation=obs)
                transcript += f"{c.text.rstrip()}\nObservation: {obs}\n"
                if seen.seconds:
                    run.ledger.charge(seconds=seen.seconds)  # may stop the run: the call is recorded
            run.event("step_limit", max_steps=self.max_steps)
            if self.force_answer:
                forced = ConstraintSpec.lark(FORCED_GRAMMAR) if self.constrained else None
                c = self._call(run, generator, base + transcript + FORCE, forced, ("\n",), "answer", forced=True)
                self._finish(run, c.text.strip(), forced=True)

        return guarded(ledger, body)

    def _call(self, run: Run, generator: Generator, text: str, constraint: ConstraintSpec | None,
              stop: tuple[str, ...], what: str, **data: Any) -> Completion:
        """One step: a call on the run's ledger, recorded as a candidate and in the trace."""
        params = dataclasses.replace(self.params, n=1, stop=() if constraint is not None else stop)
        before = run.ledger.usage
        c = generator.generate([Request(text, params, constraint=constraint)], ledger=run.ledger)[0][0]
        run.event(what, text=c.text, tokens=len(c.token_ids), finish_reason=c.finish_reason,
                  usage=run.spent_since(before), **data)
        run.candidates.append(c)
        stop_if_budget(run, [c])
        return c

    def _finish(self, run: Run, answer: str, *, forced: bool) -> None:
        run.event("final_answer", answer=answer, forced=forced)
        run.best_index, run.best_text = len(run.candidates) - 1, answer
        # the result's answer: extracted where an extractor is given, else the final answer as written
        final: list[str | None] = (extract_all(self.extractor, [Completion(answer, (), (), "stop")])
                                   if self.extractor else [answer])
        run.answers.extend([None] * (len(run.candidates) - 1) + final)


def chain_tree(run: Run, stop: str) -> dict[str, Any]:
    """The chain so far as a tree event (`metaloom.search.trace` reads it): the prompt at the
    root, one node per model call (its text and tokens; the tool it called and what came back,
    or the final answer), each call's cost a round. The final call is the best node; ``stop``:
    why a chain without a final answer ended ("step_limit", "budget")."""
    calls = [e.data for e in run.events if e.kind in ("step", "answer")]
    tools = {e.data["step"]: e.data for e in run.events if e.kind == "tool"}
    nodes: list[dict[str, Any]] = [{"id": 0, "parent": None, "depth": 0, "text": "", "tokens": 0, "state": "root",
                                    "finish": None, "round": None, "step_score": None, "score": None}]
    rounds = []
    done = run.best_index is not None
    for k, call in enumerate(calls, 1):
        last = k == len(calls)
        node: dict[str, Any] = {"id": k, "parent": k - 1, "depth": k, "text": call["text"], "tokens": call["tokens"],
                                "state": ("finished" if done else "open") if last else "expanded",
                                "finish": "eos" if last and done else (call["finish_reason"] if last else "step"),
                                "round": k - 1, "step_score": None, "score": None}
        used = tools.get(call.get("index"))
        if used is not None:
            node.update(tool=used["tool"], observation=used["observation"], tool_ok=used["ok"])
        if last and done:
            node["answer"] = run.best_text
        nodes.append(node)
        rounds.append({"round": k - 1, "expanded": [k - 1], "children": 1, "usage": call["usage"]})
    return {"strategy": "tool_chain", "best": len(calls) if done and calls else None,
            "stop": "finished" if done else stop,
            "rounds": rounds, "nodes": nodes}

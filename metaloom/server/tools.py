"""Function calling in the chat API (OpenAI's ``tools``, ``tool_choice``, ``parallel_tool_calls``).

What the model writes when it calls a function is one or more blocks, one call each, joined by
a newline — the format Qwen2.5's chat template and the Hermes models use:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

The output is generated under a grammar (llguidance's Lark dialect, `metaloom.constrain`), so a
call always names a given function and its arguments always satisfy that function's JSON Schema:

- ``tool_choice: "auto"`` (the default with tools): plain text that never contains
  ``<tool_call>``, or calls. A reply is one or the other: text followed by calls cannot be
  lexed by the grammar engine without backtracking, so the model answers or calls.
- ``"required"``: one call or more; a ``{"type": "function", "function": {"name": N}}``: one
  call of N; ``"none"``: text without calls (the tools are still shown in the prompt, as OpenAI's
  models see them).
- ``parallel_tool_calls: false``: at most one call.

The prompt: a model whose chat template renders ``tools`` (Qwen2.5's does) gets its own format,
with the history's ``tool_calls`` and ``tool`` messages as the template has them. Any other
template (the default model's has no tools) gets the documented format: a system message that
lists the functions in ``<tools>`` and shows the call format above, assistant calls written as
those blocks, and each tool result as a user turn holding ``<tool_response>`` … ``</tool_response>``.

What the model wrote is read back as calls by `metaloom.server.tool_reply`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from metaloom.constrain.grammar import grammar_text
from metaloom.constrain.spec import ConstraintSpec
from metaloom.constrain.vocab import llguidance
from metaloom.errors import InvalidGrammar, InvalidParameter

OPEN, CLOSE = "<tool_call>", "</tool_call>"
NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for a function name
EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
MODES = ("none", "auto", "required")
# arguments on one line, as `metaloom.constrain` lays out JSON (llguidance's own default lets the
# model spend tokens on newlines and indentation)
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

SYSTEM = """You may call one or more functions to help with the user's request. The functions are described \
inside <tools></tools>:
<tools>
{tools}
</tools>

To call a function, reply with nothing but one block per call:
<tool_call>
{{"name": <function-name>, "arguments": <arguments as a JSON object>}}
</tool_call>
A function's result comes back inside <tool_response></tool_response>."""


@dataclass(frozen=True)
class Function:
    """One function the model may call: its name, description and arguments' JSON Schema."""

    name: str
    description: str
    parameters: Mapping[str, Any]

    def openai(self) -> dict[str, Any]:
        """As the request gave it (what chat templates render)."""
        fn: dict[str, Any] = {"name": self.name}
        if self.description:
            fn["description"] = self.description
        fn["parameters"] = dict(self.parameters)
        return {"type": "function", "function": fn}


@dataclass(frozen=True)
class ToolChoice:
    """``mode``: none, auto or required; ``name``: the one function a named choice forces."""

    mode: str
    name: str | None = None
    parallel: bool = True


# --- the request --------------------------------------------------------------------------------

def functions(raw: Any) -> tuple[Function, ...]:
    """The ``tools`` list as `Function`s: each ``{"type": "function", "function": {name,
    description?, parameters?, strict?}}``, names unique, parameters a JSON Schema object that
    the grammar engine compiles (an `InvalidParameter` naming ``tools[i]...`` otherwise)."""
    if not isinstance(raw, list) or not raw:
        raise InvalidParameter("tools", raw, "a non-empty list of {'type': 'function', 'function': {...}}")
    out: list[Function] = []
    for i, tool in enumerate(raw):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise InvalidParameter(where, tool, "{'type': 'function', 'function': {...}}")
        extra = sorted(set(tool) - {"type", "function"})
        if extra:
            raise InvalidParameter(f"{where}.{extra[0]}", tool[extra[0]], "not set: only type and function")
        fn = tool["function"]
        extra = sorted(set(fn) - {"name", "description", "parameters", "strict"})
        if extra:
            raise InvalidParameter(f"{where}.function.{extra[0]}", fn[extra[0]],
                                   "not set: only name, description, parameters and strict")
        name = fn.get("name")
        if not isinstance(name, str) or not NAME.match(name):
            raise InvalidParameter(f"{where}.function.name", name, "1 to 64 letters, digits, underscores or dashes")
        if any(f.name == name for f in out):
            raise InvalidParameter(f"{where}.function.name", name, "a name no other tool has")
        description = fn.get("description", "")
        if not isinstance(description, str):
            raise InvalidParameter(f"{where}.function.description", description, "a string")
        if not isinstance(fn.get("strict", False), bool):
            raise InvalidParameter(f"{where}.function.strict", fn["strict"], "a boolean (arguments always follow the schema)")
        parameters = fn.get("parameters", EMPTY_PARAMETERS)
        if not isinstance(parameters, dict) or parameters.get("type", "object") != "object":
            raise InvalidParameter(f"{where}.function.parameters", parameters, "a JSON Schema of an object")
        problem = _schema_problem(parameters)
        if problem is not None:
            raise InvalidParameter(f"{where}.function.parameters", parameters,
                                   f"a JSON Schema the grammar engine compiles ({problem})")
        out.append(Function(name, description, parameters))
    return tuple(out)


def _schema_problem(schema: Mapping[str, Any]) -> str | None:
    """Why llguidance cannot compile ``schema`` (None: it can), checked without a vocabulary."""
    try:
        text = grammar_text(ConstraintSpec.json_schema(schema))
    except InvalidGrammar as exc:
        return str(exc)
    is_error, messages = llguidance().LLMatcher.validate_grammar_with_warnings(text, None)
    return (messages[0].strip() if messages else "rejected") if is_error else None


def tool_choice(raw: Any, given: Sequence[Function], parallel: Any) -> ToolChoice:
    """``tool_choice`` (default auto with tools, none without) and ``parallel_tool_calls``
    (default true) checked against the given functions."""
    if parallel is None:
        parallel = True
    if not isinstance(parallel, bool):
        raise InvalidParameter("parallel_tool_calls", parallel, "a boolean")
    if raw is None:
        return ToolChoice("auto" if given else "none", parallel=parallel)
    if isinstance(raw, str):
        if raw not in MODES:
            raise InvalidParameter("tool_choice", raw, "none, auto, required or {'type': 'function', 'function': {'name': ...}}")
        if raw != "none" and not given:
            raise InvalidParameter("tool_choice", raw, "set only with tools")
        return ToolChoice(raw, parallel=parallel)
    fn = raw.get("function") if isinstance(raw, dict) and raw.get("type") == "function" else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise InvalidParameter("tool_choice", raw, "none, auto, required or {'type': 'function', 'function': {'name': ...}}")
    if not any(f.name == name for f in given):
        raise InvalidParameter("tool_choice.function.name", name,
                               f"one of the given tools ({', '.join(f.name for f in given) or 'none given'})")
    return ToolChoice("named", name, parallel)


def history(raw: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chat messages with function calling's two additions, validated and in the shape chat
    templates take (Hugging Face's): an assistant message's ``tool_calls`` (its content may be
    null), each ``{"id", "type": "function", "function": {"name", "arguments"}}`` with the
    arguments a JSON object (OpenAI sends it as JSON text: parsed here); and ``tool`` messages,
    ``{"role": "tool", "tool_call_id", "content"}``, whose ``name`` is the call's it answers."""
    if not raw:
        raise InvalidParameter("messages", raw, "at least one message")
    out: list[dict[str, Any]] = []
    names: dict[str, str] = {}  # call id -> function name, for the tool messages that answer it
    for i, m in enumerate(raw):
        role = m.get("role")
        if role not in ("system", "developer", "user", "assistant", "tool"):
            raise InvalidParameter(f"messages[{i}].role", role, "one of system, developer, user, assistant, tool")
        allowed = {"role", "content", "name"} | ({"tool_calls"} if role == "assistant" else set()) | (
            {"tool_call_id"} if role == "tool" else set())
        extra = sorted(set(m) - allowed)
        if extra:
            raise InvalidParameter(f"messages[{i}].{extra[0]}", m[extra[0]], f"not set on a {role} message")
        calls = m.get("tool_calls") or []
        content = message_text(m.get("content"), f"messages[{i}].content", nullable=bool(calls))
        message: dict[str, Any] = {"role": "system" if role == "developer" else role, "content": content}
        if calls:
            message["tool_calls"] = [_call(c, f"messages[{i}].tool_calls[{j}]", names) for j, c in enumerate(calls)]
        if role == "tool":
            call_id = m.get("tool_call_id")
            if not isinstance(call_id, str) or not call_id:
                raise InvalidParameter(f"messages[{i}].tool_call_id", call_id, "the id of the call this answers")
            if call_id not in names:  # OpenAI refuses a result for a call nobody made
                raise InvalidParameter(f"messages[{i}].tool_call_id", call_id,
                                       "the id of a call an earlier assistant message made (its tool_calls[].id)")
            message["tool_call_id"] = call_id
            message["name"] = names[call_id]
        out.append(message)
    return out


def message_text(content: Any, where: str, nullable: bool = False) -> str:
    """A message's content as text: a string, or text parts joined (anything else is an
    `InvalidParameter` naming ``where``); None is "" where ``nullable`` (calls without text)."""
    if content is None and nullable:
        return ""
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise InvalidParameter(f"{where}[{j}]", part, "a text part {'type': 'text', 'text': ...}")
            texts.append(part["text"])
        return "".join(texts)
    if not isinstance(content, str):
        raise InvalidParameter(where, content, "a string or a list of text parts")
    return content


def _call(call: Any, where: str, names: dict[str, str]) -> dict[str, Any]:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or call.get("type", "function") != "function":
        raise InvalidParameter(where, call, "{'id': ..., 'type': 'function', 'function': {'name': ..., 'arguments': ...}}")
    arguments = fn.get("arguments", "{}")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as exc:
            raise InvalidParameter(f"{where}.function.arguments", fn.get("arguments"), f"JSON text ({exc})") from exc
    if not isinstance(arguments, dict):
        raise InvalidParameter(f"{where}.function.arguments", arguments, "a JSON object")
    if isinstance(call.get("id"), str):
        names[call["id"]] = fn["name"]
    return {"id": call.get("id"), "type": "function", "function": {"name": fn["name"], "arguments": arguments}}


# --- the prompt ---------------------------------------------------------------------------------

def native(template: str | None) -> bool:
    """Whether a chat template renders tools itself (it reads a ``tools`` variable)."""
    return template is not None and re.search(r"\btools\b", template) is not None


def documented(messages: Sequence[Mapping[str, Any]], given: Sequence[Function]) -> list[dict[str, str]]:
    """``messages`` in plain role/content form for a template without tools: the tool list in
    the system message (added after the caller's own), calls written as ``<tool_call>`` blocks,
    tool results as user turns in ``<tool_response>``."""
    out: list[dict[str, str]] = []
    for m in messages:
        if m["role"] == "tool":
            body = f"<tool_response>\n{m['content']}\n</tool_response>"
            if out and out[-1]["role"] == "user" and out[-1]["content"].startswith("<tool_response>"):
                out[-1] = {"role": "user", "content": out[-1]["content"] + "\n" + body}  # results of one turn's calls
            else:
                out.append({"role": "user", "content": body})
            continue
        content = m["content"]
        if m.get("tool_calls"):
            blocks = "\n".join(block(c["function"]["name"], json.dumps(c["function"]["arguments"], ensure_ascii=False))
                               for c in m["tool_calls"])
            content = f"{content}\n{blocks}" if content else blocks
        out.append({"role": m["role"], "content": content})
    if given:
        listing = SYSTEM.format(tools="\n".join(json.dumps(f.openai()["function"], ensure_ascii=False) for f in given))
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + listing}
        else:
            out.insert(0, {"role": "system", "content": listing})
    return out


def render(tokenizer: Any, messages: Sequence[Mapping[str, Any]], given: Sequence[Function]) -> str:
    """The prompt text: the tokenizer's own template with ``tools`` where it renders them, the
    documented format otherwise."""
    if native(getattr(tokenizer, "chat_template", None)):
        return str(tokenizer.apply_chat_template(list(messages), tools=[f.openai() for f in given] or None))
    return str(tokenizer.apply_chat_template(documented(messages, given)))


# --- the grammar --------------------------------------------------------------------------------

def block(name: str, arguments: str) -> str:
    """One call as the model writes it (``arguments``: JSON text)."""
    return f'{OPEN}\n{{"name": {json.dumps(name)}, "arguments": {arguments}}}\n{CLOSE}'


def grammar(given: Sequence[Function], choice: ToolChoice) -> ConstraintSpec:
    """The reply's grammar for ``choice`` (see the module docstring)."""
    text = r'TEXT: /(.|\n)*/ & ~/(.|\n)*<tool_call>(.|\n)*/'
    if choice.mode == "none":
        return ConstraintSpec.lark(f"start: TEXT\n{text}\n")
    chosen = [f for f in given if choice.mode != "named" or f.name == choice.name]
    rules = []
    for k, f in enumerate(chosen):
        head = json.dumps(f'{OPEN}\n{{"name": {json.dumps(f.name)}, "arguments": ')
        tail = json.dumps(f"}}\n{CLOSE}")
        schema = {**f.parameters, "x-guidance": JSON_LAYOUT}
        rules.append(f"call{k}: {head} args{k} {tail}\nargs{k}: %json {json.dumps(schema)}")
    call = "call: " + " | ".join(f"call{k}" for k in range(len(chosen)))
    calls = 'calls: call ("\\n" call)*' if choice.parallel and choice.mode != "named" else "calls: call"
    start = "start: TEXT | calls" if choice.mode == "auto" else "start: calls"
    return ConstraintSpec.lark("\n".join([start, calls, call, *rules, text]) + "\n")

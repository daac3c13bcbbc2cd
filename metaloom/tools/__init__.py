"""Tools a strategy can call (`metaloom.meta.tool_chain`): the `Tool` protocol and the registry
`TOOLS` of names to factories, each taking the `ToolSettings` it may need.

Register a tool of your own with ``TOOLS["name"] = lambda settings: MyTool()``; the strategy
then takes it by name like the built-in ones.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from metaloom.errors import InvalidParameter
from metaloom.tools.base import GRACE_S, Observation, Tool, ToolError, ToolSettings, call_tool, string_argument
from metaloom.tools.calculator import Calculator, evaluate
from metaloom.tools.python import PythonTool
from metaloom.tools.search import Search, read_corpus


def _search(settings: ToolSettings) -> Tool:
    if settings.corpus is None:
        raise InvalidParameter("corpus", None, "a text or JSONL file of documents (the search tool needs one)")
    return Search.load(settings.corpus, settings.top_k)


TOOLS: dict[str, Callable[[ToolSettings], Tool]] = {
    "calculator": lambda settings: Calculator(),
    "python": lambda settings: PythonTool.checked(settings.timeout_s),
    "search": _search,
}


def make_tools(names: Sequence[str], settings: ToolSettings) -> tuple[Tool, ...]:
    """The tools ``names`` (registry order kept as given), each built once."""
    tools = []
    for name in names:
        if name not in TOOLS:
            raise InvalidParameter("tools", name, f"names from {sorted(TOOLS)}")
        tool = TOOLS[name](settings)
        if tool.name != name:  # the model calls it by this name
            raise InvalidParameter("tools", name, f"a factory whose tool is named {name!r} (got {tool.name!r})")
        tools.append(tool)
    return tuple(tools)


__all__ = ["GRACE_S", "TOOLS", "Calculator", "Observation", "PythonTool", "Search", "Tool", "ToolError", "ToolSettings",
           "call_tool", "evaluate", "make_tools", "read_corpus", "string_argument"]

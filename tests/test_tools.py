"""The tools of `metaloom.tools`: the calculator (exact values and refusals), the python tool in
the sandbox, BM25 search, the registry, and `call_tool`'s turning failures into observations."""

import json
import time

import pytest

from metaloom.errors import InvalidParameter
from metaloom.tools import (
    TOOLS,
    Calculator,
    PythonTool,
    Search,
    Tool,
    ToolError,
    ToolSettings,
    call_tool,
    evaluate,
    make_tools,
    read_corpus,
)
from metaloom.tools.calculator import MAX_BITS


@pytest.mark.parametrize(("expression", "value"), [
    ("1 + 2 * 3", "7"), ("(1 + 2) * 3", "9"), ("7 / 2", "3.5"), ("7 // 2", "3"), ("-7 // 2", "-4"), ("10 % 3", "1"),
    ("2 ** 10", "1024"), ("-3 ** 2", "-9"), ("(-3) ** 2", "9"), ("+-+5", "-5"), ("2 ** -2", "0.25"), ("sqrt(16)", "4"),
    ("abs(-3.5)", "3.5"), ("round(2.567, 2)", "2.57"), ("round(2.5)", "2"), ("floor(-1.5)", "-2"), ("ceil(1.2)", "2"),
    ("max(1, 9, 4)", "9"), ("min(3, 2)", "2"), ("2 * pi", "6.28318530718"), ("log(e)", "1"), ("0.1 + 0.2", "0.3"),
    ("3 * 4.0", "12"), ("2 ** 4095 // 2 ** 4094", "2"), (" 12345678901234567890 * 10 ", "123456789012345678900"),
])
def test_calculator_values(expression, value):
    assert Calculator().call({"expression": expression}) == value


@pytest.mark.parametrize(("expression", "message"), [
    ("x + 1", "unknown name 'x'"),
    ("__import__('os').system('true')", "only the functions"),
    ("(1).real", "Attribute is not arithmetic"),
    ("(1).__class__.__bases__", "Attribute is not arithmetic"),
    ("'a' * 3", "only numbers are allowed"),
    ("[1, 2][0]", "is not arithmetic"),
    ("1 < 2", "Compare is not arithmetic"),
    ("True + 1", "only numbers are allowed"),
    ("lambda: 1", "Lambda is not arithmetic"),
    ("sqrt(x=4)", "positional number arguments only"),
    ("sqrt(*[4])", "positional number arguments only"),
    ("pow(2, 3)", "only the functions"),
    ("2 ** 100000", "too large"),
    ("9 ** 9 ** 9", "too large"),  # refused from logarithms: never computed (it would take minutes)
    ("0.5 ** -100000", "too large"),
    ("(2 ** 4000) * (2 ** 4000)", "result too large"),
    ("1 / 0", "ZeroDivisionError"),
    ("sqrt(-1)", "math domain error"),
    ("1e308 * 10", "not finite"),
    ("(-8) ** 0.5", "not a real number"),
    ("1 +", "not an expression"),
    ("1" * 1001, "longer than 1000"),
])
def test_calculator_refusals(expression, message):
    start = time.perf_counter()
    with pytest.raises(ToolError, match=None) as info:
        Calculator().call({"expression": expression})
    assert message in str(info.value)
    assert time.perf_counter() - start < 1.0


def test_calculator_power_limit_is_the_bit_limit():
    assert evaluate(f"2 ** {MAX_BITS - 1}") == 2 ** (MAX_BITS - 1)
    with pytest.raises(ToolError):
        evaluate(f"2 ** {MAX_BITS + 1}")


@pytest.mark.parametrize("arguments", [{}, {"expression": 3}, {"expr": "1"}, "1 + 1", None])
def test_calculator_wants_its_argument(arguments):
    with pytest.raises(ToolError, match="expected arguments"):
        Calculator().call(arguments)


def test_tools_are_tools_with_object_schemas():
    for tool in (Calculator(), PythonTool(), Search(("owls and cats",))):
        assert isinstance(tool, Tool)
        assert tool.schema["type"] == "object" and tool.schema["required"] == list(tool.schema["properties"])
        json.dumps(dict(tool.schema))


def test_python_tool_output_error_and_timeout():
    tool = PythonTool.checked(2.0)
    assert tool.call({"code": "print(sum(range(10)))"}) == "45"
    failed = tool.call({"code": "print('partial')\nraise ValueError('bad input')"})
    assert failed.startswith("partial\nError (failed): Traceback") and "ValueError: bad input" in failed
    assert "printed nothing" in tool.call({"code": "x = 1"})
    start = time.perf_counter()
    assert tool.call({"code": "while True:\n    pass"}) == "Error (timeout): timed out after 2 s"
    assert time.perf_counter() - start < 10


def test_python_tool_runs_in_the_sandbox(tmp_path):
    target = tmp_path / "escaped"
    out = PythonTool.checked(5.0).call({"code": f"open({str(target)!r}, 'w').write('x')"})
    assert "Error (failed)" in out and not target.exists()


def test_search_ranks_the_relevant_document_first():
    docs = ("The Eiffel Tower is in Paris.", "Mount Everest is the highest mountain on Earth.",
            "Paris is the capital of France.", "The Nile is a river in Africa.", "Bananas are rich in potassium.")
    search = Search.load(list(docs), top_k=2)
    assert search.ranked("What is the capital of France?")[0][0] == 2
    assert [i for i, _ in search.ranked("highest mountain")] == [1]  # no shared term: left out
    assert search.call({"query": "Paris capital"}) == "[1] Paris is the capital of France.\n[2] The Eiffel Tower is in Paris."
    assert search.call({"query": "zebra"}) == "No document matches the query."
    assert search.call({"query": "the of"}) == "No document matches the query."  # stop words only
    with pytest.raises(ToolError, match="empty"):
        search.call({"query": "  "})
    with pytest.raises(InvalidParameter, match="corpus"):
        Search(("a", "the of"))


def test_search_reads_text_and_jsonl_corpora(tmp_path):
    text = tmp_path / "docs.txt"
    text.write_text("first doc about owls\n\nsecond doc about cats\n")
    assert read_corpus(text) == ("first doc about owls", "second doc about cats")
    lines = tmp_path / "docs.jsonl"
    lines.write_text('{"text": "owls hunt at night"}\n"cats sleep a lot"\n{"contents": "dogs bark"}\n')
    search = Search.load(str(lines), top_k=1)
    assert search.documents == ("owls hunt at night", "cats sleep a lot", "dogs bark")
    assert search.call({"query": "do dogs bark"}) == "[1] dogs bark"
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"title": "no text"}\n')
    with pytest.raises(InvalidParameter, match="corpus"):
        read_corpus(bad)
    with pytest.raises(InvalidParameter, match="corpus"):
        read_corpus(tmp_path / "missing.txt")


def test_registry_builds_tools_by_name(tmp_path):
    corpus = tmp_path / "c.txt"
    corpus.write_text("one\n")
    tools = make_tools(["search", "calculator"], ToolSettings(corpus=str(corpus), top_k=2))
    assert [t.name for t in tools] == ["search", "calculator"]
    assert set(TOOLS) >= {"calculator", "python", "search"}
    with pytest.raises(InvalidParameter, match="tools"):
        make_tools(["browser"], ToolSettings())
    with pytest.raises(InvalidParameter, match="corpus"):
        make_tools(["search"], ToolSettings())
    with pytest.raises(InvalidParameter, match="top_k"):
        ToolSettings(top_k=0)
    with pytest.raises(InvalidParameter, match="tool_timeout_s"):
        ToolSettings(timeout_s=float("inf"))


class Raises:
    name, description, schema = "boom", "raises", {"type": "object"}

    def call(self, arguments):
        raise RuntimeError("kaput")


class Sleeps:
    name, description, schema = "sleepy", "sleeps", {"type": "object"}

    def call(self, arguments):
        time.sleep(30)
        return "late"


def test_call_tool_turns_failures_into_observations(monkeypatch):
    ok = call_tool(Calculator(), {"expression": "6 * 7"}, 5.0)
    assert (ok.text, ok.ok) == ("42", True) and ok.seconds >= 0
    refused = call_tool(Calculator(), {"expression": "x"}, 5.0)
    assert not refused.ok and refused.text.startswith("Error: unknown name 'x'")
    crashed = call_tool(Raises(), {}, 5.0)
    assert (crashed.text, crashed.ok) == ("Error: RuntimeError: kaput", False)
    monkeypatch.setattr("metaloom.tools.base.GRACE_S", 0.0)
    start = time.perf_counter()
    late = call_tool(Sleeps(), {}, 0.2)
    assert (late.text, late.ok) == ("Error: the sleepy tool timed out after 0.2 s", False)
    assert 0.2 <= late.seconds < 5 and time.perf_counter() - start < 5

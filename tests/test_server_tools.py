"""Function calling in `metaloom serve` (`metaloom.server.tools`): the request's checks, the
prompt in the documented format and in a template's own, the reply's grammar per tool choice,
reading replies whole and streamed; then the real `openai` client against the default model,
a two-turn loop included (call, tool result, final answer)."""

from __future__ import annotations

import json

import pytest

from metaloom.constrain.grammar import compile_constraint
from metaloom.constrain.vocab import Vocabulary
from metaloom.errors import InvalidParameter
from metaloom.generator import LocalGenerator
from metaloom.server import tool_reply, tools
from tests.test_server import serving

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                     "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}}


def _functions(*raw):
    return tools.functions(list(raw))


# --- the request ---------------------------------------------------------------------------------

@pytest.mark.parametrize("raw, where", [
    ([], "tools"),
    ([{"type": "web", "function": {"name": "x"}}], "tools[0]"),
    ([{"type": "function", "function": {"name": "bad name!"}}], "tools[0].function.name"),
    ([WEATHER, WEATHER], "tools[1].function.name"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}], "tools[0].function.parameters"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "x": {"type": "string", "pattern": "(?<=a)b"}}}}}], "tools[0].function.parameters"),  # no look-behind
    ([{"type": "function", "function": {"name": "f", "colour": "red"}}], "tools[0].function.colour"),
])
def test_bad_tools_name_the_field(raw, where):
    with pytest.raises(InvalidParameter) as err:
        tools.functions(raw)
    assert err.value.name == where


def test_tool_choice_defaults_and_refusals():
    given = _functions(WEATHER, TIME)
    assert tools.tool_choice(None, given, None) == tools.ToolChoice("auto")
    assert tools.tool_choice(None, (), None) == tools.ToolChoice("none")
    named = tools.tool_choice({"type": "function", "function": {"name": "get_time"}}, given, False)
    assert named == tools.ToolChoice("named", "get_time", parallel=False)
    with pytest.raises(InvalidParameter, match="one of the given tools") as err:
        tools.tool_choice({"type": "function", "function": {"name": "get_news"}}, given, None)
    assert err.value.name == "tool_choice.function.name"
    for bad, where in (("sometimes", "tool_choice"), ("required", "tool_choice")):
        with pytest.raises(InvalidParameter) as err:
            tools.tool_choice(bad, () if bad == "required" else given, None)
        assert err.value.name == where
    with pytest.raises(InvalidParameter) as err:
        tools.tool_choice("auto", given, "yes")
    assert err.value.name == "parallel_tool_calls"


def test_history_takes_calls_and_results_in_templates_shape():
    raw = [{"role": "user", "content": "Weather in Paris?"},
           {"role": "assistant", "content": None, "tool_calls": [
               {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                                 "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
           {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"}]
    out = tools.history(raw)
    assert out[1] == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": {"city": "Paris", "unit": "celsius"}}}]}
    assert out[2] == {"role": "tool", "content": "18 C, sunny", "tool_call_id": "call_1", "name": "get_weather"}
    bad = [dict(raw[0]), {**raw[1], "tool_calls": [{"id": "c", "type": "function",
                                                      "function": {"name": "f", "arguments": "{oops"}}]}]
    with pytest.raises(InvalidParameter) as err:
        tools.history(bad)
    assert err.value.name == "messages[1].tool_calls[0].function.arguments"
    with pytest.raises(InvalidParameter) as err:
        tools.history([{"role": "tool", "content": "x"}])
    assert err.value.name == "messages[0].tool_call_id"
    with pytest.raises(InvalidParameter) as err:
        tools.history([{"role": "user", "content": "x", "tool_calls": []}])
    assert err.value.name == "messages[0].tool_calls"


# --- the prompt ----------------------------------------------------------------------------------

def test_the_documented_format_lists_the_tools_and_writes_calls_and_results_as_blocks():
    given = _functions(WEATHER)
    msgs = tools.history([
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "a", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "b", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Lyon"}'}}]},
        {"role": "tool", "tool_call_id": "a", "content": "18 C"}, {"role": "tool", "tool_call_id": "b", "content": "20 C"}])
    out = tools.documented(msgs, given)
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    assert out[0]["content"].startswith("Be brief.\n\nYou may call one or more functions")
    assert json.dumps(WEATHER["function"]) in out[0]["content"]
    assert out[2]["content"] == ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
                                 '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lyon"}}\n</tool_call>')
    assert out[3]["content"] == "<tool_response>\n18 C\n</tool_response>\n<tool_response>\n20 C\n</tool_response>"


class _Templated:
    """A tokenizer whose template renders tools (as Qwen2.5's does), recording what it got."""

    chat_template = "{% if tools %}{{ tools | tojson }}{% endif %}..."

    def apply_chat_template(self, messages, tools=None, **_):
        self.got = (messages, tools)
        return "rendered"


def test_a_template_that_renders_tools_gets_them_and_the_history_as_is():
    tok = _Templated()
    given = _functions(WEATHER)
    msgs = tools.history([{"role": "user", "content": "hi"}])
    assert tools.render(tok, msgs, given) == "rendered"
    assert tok.got == (msgs, [WEATHER])
    assert not tools.native("{% for m in messages %}{{ m.content }}{% endfor %}")


# --- the grammar ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def vocab(smollm):
    return Vocabulary(smollm.tokenizer, smollm.model.vocab_size)


def _accepts(vocab, tokenizer, spec, text: str) -> bool:
    cursor = compile_constraint(spec, vocab).cursor()
    for t in tokenizer.encode(text, add_special_tokens=False):
        if not bool(cursor.mask()[t]):
            return False
        cursor.advance(t)
    return cursor.accepting()


PARIS = tools.block("get_weather", '{"city": "Paris", "unit": "celsius"}')
NOON = tools.block("get_time", '{"zone": "CET"}')


def test_each_tool_choice_allows_what_it_says(vocab, smollm):
    given = _functions(WEATHER, TIME)

    def ok(spec, text):
        return _accepts(vocab, smollm.tokenizer, spec, text)

    def spec(choice, parallel=True, name=None):
        return tools.grammar(given, tools.ToolChoice(choice, name, parallel))

    auto, required, none = spec("auto"), spec("required"), spec("none")
    assert ok(auto, "It is sunny.") and ok(auto, PARIS) and ok(auto, PARIS + "\n" + NOON)
    assert not ok(auto, "Let me check. " + PARIS)  # an answer or calls, not both
    assert not ok(auto, tools.block("get_weather", '{"city": "Paris"}'))  # unit is required
    assert not ok(auto, tools.block("get_news", "{}"))  # no such function
    assert not ok(required, "It is sunny.") and ok(required, NOON)
    assert ok(none, "It is sunny.") and not ok(none, PARIS)
    assert not ok(spec("auto", parallel=False), PARIS + "\n" + NOON)
    named = spec("named", name="get_time")
    assert ok(named, NOON) and not ok(named, PARIS)


# --- the reply -----------------------------------------------------------------------------------

def test_parse_reads_calls_only_from_well_formed_blocks():
    assert tool_reply.parse(PARIS + "\n" + NOON) == (None, [("get_weather", '{"city": "Paris", "unit": "celsius"}'),
                                                      ("get_time", '{"zone": "CET"}')])
    assert tool_reply.parse("Sunny.") == ("Sunny.", [])
    cut = PARIS[:-5]  # max_tokens mid-call: no call, and its markup is no answer either
    assert tool_reply.parse(cut) == ("", [])
    assert tool_reply.parse("<tool") == ("<tool", [])  # text that never opened a call is text


def test_whole_calls_survive_a_cut_and_a_repeated_call_is_dropped():
    """The reported case: greedy with tool_choice required repeats its call until max_tokens.
    The whole calls come back (each once); the cut one never does; no markup leaks."""
    repeated = PARIS + "\n" + PARIS + "\n" + PARIS[:30]
    assert tool_reply.parse(repeated) == (None, [("get_weather", '{"city": "Paris", "unit": "celsius"}')])
    cut_after_two = PARIS + "\n" + NOON + "\n" + NOON[:-9]
    assert tool_reply.parse(cut_after_two)[1] == [("get_weather", '{"city": "Paris", "unit": "celsius"}'),
                                             ("get_time", '{"zone": "CET"}')]
    assert tool_reply.finish_reason(repeated, "length") == "tool_calls"  # it ended by repeating itself
    assert tool_reply.finish_reason(cut_after_two, "length") == "length"  # a new call was cut: say so
    assert tool_reply.finish_reason(PARIS, "stop") == "tool_calls" and tool_reply.finish_reason("Sunny.", "stop") == "stop"
    message, called = tool_reply.message(repeated)
    assert called and message["content"] is None and len(message["tool_calls"]) == 1


def test_the_stream_sends_each_whole_call_once_and_agrees_with_the_finished_reply():
    text = PARIS + "\n" + tools.block("get_time", '{"zone": "a \\" } b"}')  # a brace and a quote inside a string
    for step in (1, 3, 7):
        stream = tool_reply.ToolStream()
        deltas = [d for i in range(0, len(text), step) for d in stream.feed(text[i:i + step])] + stream.finish()
        assert stream.calls and not any("content" in d for d in deltas)
        calls = [d["tool_calls"][0] for d in deltas]
        assert [(c["index"], c["function"]["name"]) for c in calls] == [(0, "get_weather"), (1, "get_time")]
        assert all(c["id"].startswith("call_") for c in calls)
        assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"city": "Paris", "unit": "celsius"},
                                                                         {"zone": 'a " } b'}]
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == tool_reply.parse(text)[1]
    stream = tool_reply.ToolStream()
    repeated = PARIS + "\n" + PARIS + "\n" + PARIS[:20]
    deltas = [d for ch in repeated for d in stream.feed(ch)] + stream.finish()
    assert stream.repeated and len(deltas) == 1 and deltas[0]["tool_calls"][0]["function"]["arguments"] == (
        '{"city": "Paris", "unit": "celsius"}')
    stream = tool_reply.ToolStream()
    assert [d for ch in PARIS[:-3] for d in stream.feed(ch)] + stream.finish() == []  # a cut call: nothing at all
    stream = tool_reply.ToolStream()
    held = stream.feed("<to")  # could still open a call: held back
    assert held == [] and stream.feed("day it rains") == [{"content": "<today it rains"}]
    stream = tool_reply.ToolStream()
    assert stream.feed("<tool") == [] and stream.finish() == [{"content": "<tool"}] and not stream.calls


# --- the server, through the openai client --------------------------------------------------------

@pytest.fixture(scope="module")
def served(smollm):
    with serving(LocalGenerator(smollm)) as s:
        yield s


def test_required_calls_come_back_as_tool_calls_with_schema_valid_arguments(served):
    r = served.client().chat.completions.create(
        model="default", messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False, max_tokens=80, temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = choice.message.tool_calls
    assert len(calls) == 1 and all(c.id.startswith("call_") and c.type == "function" for c in calls)
    for c in calls:
        args = json.loads(c.function.arguments)
        if c.function.name == "get_weather":
            assert set(args) == {"city", "unit"} and args["unit"] in ("celsius", "fahrenheit")
        else:
            assert c.function.name == "get_time" and isinstance(args["zone"], str)


def test_a_two_turn_loop_call_result_answer_streamed_and_not(served):
    client = served.client()
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = client.chat.completions.create(model="default", messages=messages, tools=[WEATHER],
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                           parallel_tool_calls=False, max_tokens=60, temperature=0)
    call = first.choices[0].message.tool_calls[0]
    assert first.choices[0].finish_reason == "tool_calls" and len(first.choices[0].message.tool_calls) == 1
    messages += [first.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 18, "sky": "sunny"}'}]
    final = client.chat.completions.create(model="default", messages=messages, tools=[WEATHER], tool_choice="none",
                                           max_tokens=40, temperature=0)
    answer = final.choices[0]
    assert answer.message.tool_calls is None and answer.message.content and "<tool_call>" not in answer.message.content
    assert answer.finish_reason in ("stop", "length")
    # the same first turn streamed: the deltas join to the same call
    chunks = list(client.chat.completions.create(
        model="default", messages=messages[:1], tools=[WEATHER], parallel_tool_calls=False, stream=True,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=60, temperature=0))
    parts = [tc for ch in chunks for d in [ch.choices[0].delta] if d.tool_calls for tc in d.tool_calls]
    assert parts[0].function.name == "get_weather" and parts[0].id.startswith("call_")
    assert "".join(p.function.arguments or "" for p in parts) == call.function.arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_auto_may_answer_in_text(served):
    r = served.client().chat.completions.create(
        model="default", messages=[{"role": "user", "content": "Say hello."}], tools=[WEATHER],
        tool_choice="none", max_tokens=12, temperature=0)
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content


@pytest.mark.parametrize("extra, param", [
    ({"tool_choice": {"type": "function", "function": {"name": "get_news"}}}, "tool_choice.function.name"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "x": {"type": "string", "pattern": "(?<=a)b"}}}}}]}, "tools[0].function.parameters"),
    ({"metaloom": {"strategy": "majority_vote", "params": {"n": 2}}}, "tools"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "tool", "tool_call_id": "call_nobody", "content": "18"}]},
     "messages[1].tool_call_id"),
])
def test_bad_function_calling_requests_are_400s_naming_the_field(served, extra, param):
    import httpx2 as httpx

    body = {"model": "default", "messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER], **extra}
    r = httpx.post(served.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


WEATHER_CITY = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                                 "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                                "required": ["city"]}}}


@pytest.mark.parametrize("choice", ["required", "auto"])
def test_the_simplest_weather_example_gets_a_usable_call_streamed_and_not(served, choice):
    """The reported case (issue 46): tool_choice required at temperature 0 and max_tokens 64 made
    the default model repeat its call to max_tokens; the client got raw markup as content (or a
    truncated call streamed). Now: whole calls, once each, the same both ways, the row ended."""
    client = served.client()
    asked = dict(model="default", messages=[{"role": "user", "content": "What is the weather in Paris?"}],
                 tools=[WEATHER_CITY], tool_choice=choice, max_tokens=64, temperature=0)
    r = client.chat.completions.create(**asked)
    message = r.choices[0].message
    if choice == "auto" and not message.tool_calls:  # auto may answer in text: then no markup in it
        assert "<tool_call>" not in (message.content or "")
        return
    assert message.content is None and message.tool_calls
    calls = [(c.function.name, c.function.arguments) for c in message.tool_calls]
    assert len(set(calls)) == len(calls) and all(json.loads(a)["city"] for _, a in calls)
    assert r.choices[0].finish_reason == "tool_calls"
    assert r.usage.completion_tokens < 64  # the repeat ended the row: nobody decodes to max_tokens for nothing
    chunks = list(client.chat.completions.create(**asked, stream=True))
    streamed = [(tc.function.name, tc.function.arguments) for ch in chunks if ch.choices
                for tc in (ch.choices[0].delta.tool_calls or [])]
    assert streamed == calls
    assert not any(ch.choices[0].delta.content for ch in chunks if ch.choices)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_tokenize_counts_a_tool_conversation_as_the_chat_route_reads_it(served, smollm):
    import httpx2 as httpx

    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 18}'}]
    r = httpx.post(served.url + "/tokenize", json={"model": "default", "messages": messages, "tools": [WEATHER_CITY]},
                   timeout=60)
    assert r.status_code == 200, r.text
    expected = smollm.tokenizer.encode(
        tools.render(smollm.tokenizer, tools.history(messages), tools.functions([WEATHER_CITY])), add_special_tokens=False)
    assert r.json()["tokens"] == expected
    chat = served.client().chat.completions.create(model="default", messages=messages, tools=[WEATHER_CITY],
                                                   tool_choice="none", max_tokens=1, temperature=0)
    assert chat.usage.prompt_tokens == r.json()["count"]


@pytest.mark.parametrize("field, value, words", [
    ("guided_regex", "[", "unclosed character class"),
    ("guided_regex", "[^\\x00-\\U0010FFFF]", "no text satisfies it"),
    ("response_format", {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "integer", "minimum": 5, "maximum": 1}}}, "minimum (5) is greater than maximum (1)"),
])
def test_constraint_errors_name_their_field_in_one_sentence(served, field, value, words):
    import httpx2 as httpx

    body = {"model": "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, field: value}
    r = httpx.post(served.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == field and words in error["message"]
    assert "<state>" not in error["message"] and "\n" not in error["message"]

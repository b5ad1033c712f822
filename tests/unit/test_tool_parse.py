"""Function calling's answer: parsed back into calls, the stream giving what the parse gives
however the text is split, and templates that render tools themselves (OpenAI's history shape,
Llama 3's bare JSON calls read by the library's parser)."""

from __future__ import annotations

import itertools
import json
import random
from typing import Any

import pytest

from services.gateway.tool_stream import ToolStream
from services.gateway.tools import (
    ToolPlan,
    parse,
    plan,
)
from tests.helpers.tool_cases import TOOLS, make_id, named

# -- parsing the answer -----------------------------------------------------------------------


def call(i: int, name: str, arguments: str) -> dict[str, Any]:
    return {"id": f"call_{i}", "type": "function", "function": {"name": name, "arguments": arguments}}


AUTO = plan([], TOOLS, "auto")
AUTO_ONE = plan([], TOOLS, "auto", parallel_tool_calls=False)
REQUIRED = plan([], TOOLS, "required")
REQUIRED_ONE = plan([], TOOLS, "required", parallel_tool_calls=False)
NAMED = plan([], TOOLS, named("get_weather"))
NONE = plan([], TOOLS, "none")

PARIS = '{"city":"Paris","unit":"c"}'
BLOCK = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>'
NOW = '<tool_call>{"name": "now", "parameters": {}}</tool_call>'


def test_parse_none_and_named() -> None:
    assert parse(f"  {BLOCK} ", NONE, make_id()) == (f"  {BLOCK} ", [])
    text = '{\n  "city": "San Francisco, CA",\n  "unit": "c"\n\n}'
    arguments = '{"city":"San Francisco, CA","unit":"c"}'
    assert parse(text, NAMED, make_id()) == (None, [call(0, "get_weather", arguments)])
    # Whitespace inside strings and escaped quotes survive the compaction.
    text = '{ "city" : "a \\" b\\\\", "unit":\t"f" }'
    assert parse(text, NAMED, make_id())[1][0]["function"]["arguments"] == '{"city":"a \\" b\\\\","unit":"f"}'
    # Cut by max_tokens: the arguments as far as they went (what the stream sent).
    assert parse('{"city": "Pa', NAMED, make_id()) == (None, [call(0, "get_weather", '{"city":"Pa')])


def test_parse_required() -> None:
    text = (
        '[\n{"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}},\n{"name": "now", "parameters": {}}]'
    )
    expected = [call(0, "get_weather", PARIS), call(1, "now", "{}")]
    assert parse(text, REQUIRED, make_id()) == (None, expected)
    assert parse(text, REQUIRED_ONE, make_id()) == (None, expected[:1])
    for partial in (
        '[{"name": "now", "parameters": {',
        "[]",
        '[{"name": "sleep", "parameters": {}}]',
        '[{"name": "now", "parameters": 3}]',
        '{"name": "now", "parameters": {}}',
    ):
        assert parse(partial, REQUIRED, make_id()) == (partial, [])


def test_parse_auto_calls_and_content() -> None:
    assert parse(BLOCK, AUTO, make_id()) == (None, [call(0, "get_weather", PARIS)])
    text = f"Let me check.\n{BLOCK}\n{NOW}\n"
    both = [call(0, "get_weather", PARIS), call(1, "now", "{}")]
    assert parse(text, AUTO, make_id()) == ("Let me check.", both)
    assert parse(text, AUTO_ONE, make_id()) == ("Let me check.", [call(0, "get_weather", PARIS)])
    assert parse("  Just prose.\n", AUTO, make_id()) == ("Just prose.", [])
    assert parse("", AUTO, make_id()) == ("", [])
    # Arguments given as JSON text, as some models write them.
    quoted = '<tool_call>{"name": "now", "arguments": "{}"}</tool_call>'
    assert parse(quoted, AUTO, make_id()) == (None, [call(0, "now", "{}")])


@pytest.mark.parametrize(
    "block",
    [
        "<tool_call>{not json}</tool_call>",
        '<tool_call>{"name": "sleep", "arguments": {}}</tool_call>',  # not declared
        '<tool_call>{"name": "now", "arguments": [1]}</tool_call>',
        '<tool_call>{"arguments": {}}</tool_call>',
        '<tool_call>["now"]</tool_call>',
    ],
)
def test_parse_auto_keeps_what_is_not_a_call(block: str) -> None:
    assert parse(f"A {block} B {NOW}", AUTO, make_id()) == (f"A {block} B", [call(0, "now", "{}")])


def test_parse_auto_block_cut_short() -> None:
    """Generation stopped by max_tokens inside a block: a complete JSON still makes a call."""
    cut = '<tool_call>\n{"name": "now", "arguments": {}}'
    assert parse(f"Hi {cut}", AUTO, make_id()) == ("Hi", [call(0, "now", "{}")])
    cut = '<tool_call>\n{"name": "now", "argu'
    assert parse(f"Hi {cut}", AUTO, make_id()) == (f"Hi {cut}", [])
    assert parse("Hi <tool_call>", AUTO, make_id()) == ("Hi <tool_call>", [])
    stray = f"{BLOCK} </tool_call> <tool_"
    assert parse(stray, AUTO, make_id()) == ("</tool_call> <tool_", [call(0, "get_weather", PARIS)])


# -- streaming --------------------------------------------------------------------------------


def assemble(deltas: list[dict[str, Any]]) -> tuple[str | None, list[dict[str, Any]]]:
    """What a client makes of the deltas: the content, and each call from its opening and fragments."""
    content, calls = "", []
    for delta in deltas:
        assert len(delta) == 1
        content += delta.get("content", "")
        for piece in delta.get("tool_calls", []):
            if "id" in piece:
                assert piece["index"] == len(calls) and piece["function"]["arguments"] == ""
                calls.append({"id": piece["id"], "type": piece["type"], "function": dict(piece["function"])})
            else:
                assert set(piece) == {"index", "function"} and piece["index"] == len(calls) - 1
                calls[-1]["function"]["arguments"] += piece["function"]["arguments"]
    return (content or (None if calls else "")), calls


def stream(text: str, p: ToolPlan, cuts: list[int]) -> tuple[list[dict[str, Any]], ToolStream]:
    s = ToolStream(p, make_id())
    deltas: list[dict[str, Any]] = []
    for a, b in itertools.pairwise([0, *cuts, len(text)]):
        deltas += s.feed(text[a:b])
    deltas += s.finish()
    assert all(d.get("content", "x") for d in deltas)  # no empty content delta
    return deltas, s


TEXTS = [
    (AUTO, f"Let me check.\n{BLOCK}\n{NOW}\nDone <tool_c"),
    (AUTO, f"A <tool_call>{{not json}}</tool_call> B {NOW}  "),
    (AUTO, '  <tool_call>{"name": "sleep", "arguments": {}}</tool_call>\n\nWell <'),
    (AUTO, f'{BLOCK}<tool_call>\n{{"name": "now", "arguments": {{}}}}'),
    (AUTO, 'Hi <tool_call>\n{"name": "now", "argu'),
    (AUTO, "Plain prose, with < and <tool and </tool_call> in it.\n"),
    (AUTO, "<tool_call><tool_call></tool_call></tool_call>"),
    (AUTO, "Ünïcödé ☃ text"),
    (AUTO, ""),
    (AUTO_ONE, f"Sure. {NOW} and {BLOCK} then"),
    (
        REQUIRED,
        '[{"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}}, {"name": "now", "parameters": {}}]',
    ),
    (REQUIRED_ONE, '[{"name": "now", "parameters": {}}]'),
    (REQUIRED, '[{"name": "now", "parameters": {'),
    (NAMED, '{\n  "city": "A \\"quoted\\" city",\n  "unit": "c"\n}'),
    (NAMED, ""),
    (NONE, f" {BLOCK} "),
]


@pytest.mark.parametrize(("p", "text"), TEXTS)
def test_stream_gives_what_parse_gives(p: ToolPlan, text: str) -> None:
    expected = parse(text, p, make_id())
    rng = random.Random(len(text))
    splits = [[], [*range(1, len(text))]]  # whole, and a character at a time
    splits += [[i] for i in range(1, len(text))]  # every single cut, inside the tags included
    splits += [sorted(rng.sample(range(1, len(text)), min(max(len(text) - 1, 0), k))) for k in (2, 3, 5, 8) * 5]
    for cuts in splits:
        deltas, s = stream(text, p, cuts)
        assert assemble(deltas) == expected, cuts
        assert s.called == bool(expected[1])


def opening(index: int, call_id: str, name: str) -> dict[str, Any]:
    return {
        "tool_calls": [{"index": index, "id": call_id, "type": "function", "function": {"name": name, "arguments": ""}}]
    }


def fragment(index: int, arguments: str) -> dict[str, Any]:
    return {"tool_calls": [{"index": index, "function": {"arguments": arguments}}]}


def test_auto_stream_sends_content_at_once_and_holds_only_a_possible_tag() -> None:
    s = ToolStream(AUTO, make_id())
    assert s.feed("Hello there") == [{"content": "Hello there"}]
    assert s.feed(" <tool_") == []  # the space and what may be a tag wait
    assert s.feed("cal") == []
    assert s.feed('l>{"name": "now", "arguments": {}}') == []  # inside a block: held until it closes
    assert s.feed("</tool_call>") == [
        opening(0, "call_0", "now"),
        fragment(0, "{}"),
    ]
    assert s.called
    assert s.feed(" <to") == []
    assert s.feed("p>") == [{"content": "  <top>"}]  # the space before the call, and this one
    assert s.finish() == []


def test_named_stream_sends_arguments_as_they_come() -> None:
    s = ToolStream(NAMED, make_id())
    assert s.feed("") == [opening(0, "call_0", "get_weather")]
    assert s.called
    assert s.feed('{\n  "city": "Par') == [fragment(0, '{"city":"Par')]
    assert s.feed("is, \n") == [fragment(0, "is, \n")]  # in a string
    assert s.feed('"\n  ') == [fragment(0, '"')]
    assert s.feed("\n  ") == []
    assert s.feed(" }") == [fragment(0, "}")]
    assert s.finish() == []


def test_required_stream_waits_for_the_end() -> None:
    s = ToolStream(REQUIRED, make_id())
    assert s.feed('[{"name": "now", "parameters": {}}]') == []
    assert not s.called
    assert s.finish() == [
        opening(0, "call_0", "now"),
        fragment(0, "{}"),
    ]
    assert s.called


def test_none_stream_passes_text_through() -> None:
    s = ToolStream(NONE, make_id())
    assert s.feed(" <tool_call>") == [{"content": " <tool_call>"}]
    assert s.feed("") == [] and s.finish() == [] and not s.called


def test_a_template_that_renders_tools_gets_them_and_the_history_in_openais_shape() -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    history = [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "cold"},
    ]
    auto = plan(history, TOOLS, "auto", native=True)
    assert auto.template_tools == [{"type": "function", "function": t.function.shown()} for t in TOOLS]
    assert [m["role"] for m in auto.messages] == ["system", "user", "assistant", "tool"]
    assert auto.messages[0]["content"] == "Be brief."  # no prompt of Tessera's: the template shows the tools
    assert auto.messages[2]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}
    assert auto.messages[3]["tool_call_id"] == "c1"
    # "required" still tells the model the one shape the engine enforces, on the same history.
    required = plan(history, TOOLS, "required", native=True)
    assert required.template_tools is None and required.json_schema is not None
    assert required.messages[0]["content"].startswith("# Tools") and required.messages[0]["content"].endswith(
        "Be brief."
    )
    assert required.messages[3]["role"] == "tool"
    # Without a template that renders tools, the history is text in Hermes' format, as before.
    plain = plan(history, TOOLS, "auto")
    assert plain.template_tools is None and "<tool_call>" in plain.messages[2]["content"]


@pytest.mark.parametrize("cut", [1, 3, 7, 1000])
def test_a_bare_json_call_is_read_by_the_librarys_llama3_parser_streamed_or_not(cut: int) -> None:
    """Llama 3.1's templates ask for a call as a bare `{"name", "parameters"}` object: such an
    answer is a call (OpenVINO GenAI's `Llama3JsonToolParser` reads it), and streamed it gives
    the same call, held until the answer ends; any other answer stays content."""
    p = plan([{"role": "user", "content": "Weather?"}], TOOLS, "auto", native=True, bare_json=True)
    text = '{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "c"}}'
    content, calls = parse(text, p, lambda: "call_1")
    assert content is None and [c["function"]["name"] for c in calls] == ["get_weather"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo", "unit": "c"}
    stream = ToolStream(p, lambda: "call_1")
    deltas = [d for i in range(0, len(text), cut) for d in stream.feed(text[i : i + cut])] + stream.finish()
    assert not any("content" in d for d in deltas)
    assert (
        "".join(d["tool_calls"][0]["function"].get("arguments", "") for d in deltas)
        == calls[0]["function"]["arguments"]
    )
    for other in ('{"name": "unknown", "parameters": {}}', "It is cold in Oslo.", '{"a": 1}'):
        assert parse(other, p, lambda: "x") == (other, [])
        stream = ToolStream(p, lambda: "x")
        said = [d for i in range(0, len(other), cut) for d in stream.feed(other[i : i + cut])] + stream.finish()
        assert "".join(d["content"] for d in said) == other

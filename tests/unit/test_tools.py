"""Function calling on a template without tools: the prompt and history rendered in Qwen2.5's
format, the schemas the engine enforces (and, once, that the real library enforces them), the
answer parsed back, and the stream giving what the parse gives however the text is split."""

from __future__ import annotations

import itertools
import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from services.gateway.tool_stream import ToolStream
from services.gateway.tools import (
    NO_ARGUMENTS,
    FunctionDef,
    Tool,
    ToolPlan,
    check_tool_choice,
    parse,
    plan,
)

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "unit": {"type": "string", "enum": ["c", "f"]},
        "where": {
            "type": "object",
            "properties": {"lat": {"type": "number"}, "lon": {"type": "number"}},
            "required": ["lat", "lon"],
            "additionalProperties": False,
        },
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}


def tool(name: str, parameters: dict[str, Any] | None = None, description: str | None = None) -> Tool:
    return Tool.model_validate(
        {"type": "function", "function": {"name": name, "description": description, "parameters": parameters}}
    )


TOOLS = [tool("get_weather", WEATHER, "The weather in a city"), tool("now")]


def make_id() -> Callable[[], str]:
    """Ids call_0, call_1, ...: a fresh count for each parse or stream compared."""
    count = itertools.count()
    return lambda: f"call_{next(count)}"


def named(name: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name}}


# -- tool_choice and tool definitions ---------------------------------------------------------


def test_tool_choice_modes() -> None:
    assert check_tool_choice(TOOLS, None) == ("auto", None)
    assert check_tool_choice(None, None) == ("none", None)
    assert check_tool_choice([], "auto") == ("none", None)  # nothing to call
    assert check_tool_choice(TOOLS, "none") == ("none", None)
    assert check_tool_choice(TOOLS, "required") == ("required", None)
    assert check_tool_choice(TOOLS, named("now")) == ("named", "now")


@pytest.mark.parametrize(
    ("tools", "choice", "says"),
    [
        (TOOLS, named("get_time"), "'get_time', which is not in `tools`"),
        (None, named("now"), "not in `tools`"),
        (None, "required", "needs at least one function"),
        ([], "required", "needs at least one function"),
        (TOOLS, "sometimes", "tool_choice must be"),
        (TOOLS, {"type": "function"}, "tool_choice must be"),
        (TOOLS, {"function": {"name": "now"}}, "tool_choice must be"),
        (TOOLS, {"type": "function", "function": {"name": 3}}, "tool_choice must be"),
        (TOOLS, 1, "tool_choice must be"),
    ],
)
def test_tool_choice_errors(tools: list[Tool] | None, choice: Any, says: str) -> None:
    with pytest.raises(ValueError) as e:
        check_tool_choice(tools, choice)
    assert says in str(e.value)


@pytest.mark.parametrize("name", ["", "a b", "x" * 65, "fn.call", "ünï"])
def test_function_names(name: str) -> None:
    with pytest.raises(ValidationError):
        FunctionDef(name=name)


# Each refused by OpenVINO GenAI 2026.4's xgrammar, measured; a refusal inside the pipeline's
# step() leaves it unusable for every request, so these must be 400s.
REFUSED = [
    {"type": "object", "properties": {"a": {"type": "strin"}}},
    {"type": "object", "properties": {"a": {"type": 5}}},
    {"type": "object", "properties": {"a": {"type": ["string", "foo"]}}},
    {"type": "object", "properties": {"a": {"$ref": "#/$defs/Nope"}}},
    {"type": "object", "$defs": {"a/b": {"type": "integer"}}, "properties": {"x": {"$ref": "#/$defs/a~1b"}}},
    {"type": "object", "properties": {"a": {"anyOf": [{"type": "integer"}]}, "b": {"$ref": "#/properties/a/anyOf/0"}}},
    {"type": "object", "properties": {"t": {"type": "array", "items": [{"type": "integer"}]}}},
    {"type": "object", "properties": {"t": {"enum": "x"}}},
    {"type": "object", "properties": {"t": {"enum": []}}},
    {"type": "object", "properties": {"a": {"type": "string"}}, "required": "a"},
    {"type": "object", "properties": [{"type": "string"}]},
    {"type": "object", "properties": {"a": {"anyOf": []}}},
    {"type": "object", "properties": {"a": {"type": "array", "minItems": "1"}}},
    {"type": "object", "properties": {"a": {"type": "array", "minItems": 3, "maxItems": 1}}},
    {"type": "object", "properties": {"a": {"type": "string", "pattern": "(["}}},
    {"type": "object", "properties": {"a": {"type": "string", "pattern": "(?=a)a+"}}},
    {"type": "object", "properties": {"a": {"type": "string", "pattern": "^(a)\\1$"}}},
    {"type": "object", "properties": {"a": {"type": "string", "pattern": "\\bab\\b"}}},
    {"type": "object", "properties": {"a": {"type": "string", "pattern": "(?i)ab"}}},
]

ACCEPTED = [
    WEATHER,
    {"properties": {"a": {"type": "integer"}}},  # no type: an object all the same
    {"type": "object", "properties": {"type": {"type": "string"}, "$ref": {"type": "string"}}},
    {"type": "object", "$defs": {"P": {"type": "integer"}}, "properties": {"a": {"$ref": "#/$defs/P"}}},
    {"type": "object", "definitions": {"P": {"type": "integer"}}, "properties": {"a": {"$ref": "#/definitions/P"}}},
    {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#"}}}},
    {"type": "object", "properties": {"a": True, "b": {"not": {"type": "string"}}}},
    {"type": "object", "properties": {"a": {"type": "string", "pattern": "^(?:ab)+[\\w.-]\\d{2,}$"}}},
    {"type": "object", "properties": {"a": {"$ref": "https://example.com/a.json"}}},
    {"type": "object", "properties": {"a": {"type": ["string", "null"], "minLength": 1, "maxLength": 4}}},
]


@pytest.mark.parametrize("schema", REFUSED)
def test_parameters_the_engine_would_refuse(schema: dict[str, Any]) -> None:
    """Refused where the engine would enforce them; "auto" only shows them to the model."""
    tools = [tool("now"), tool("f", schema)]
    for choice in ("required", named("f")):
        with pytest.raises(ValueError, match=r"^tools\[1\]\.function\.parameters.*cannot enforce"):
            check_tool_choice(tools, choice)
    assert check_tool_choice(tools, named("now")) == ("named", "now")
    assert plan([], tools, "auto").mode == "auto"


@pytest.mark.parametrize("schema", ACCEPTED)
def test_parameters_accepted(schema: dict[str, Any]) -> None:
    tools = [tool("f", schema)]
    assert check_tool_choice(tools, "required") == ("required", None)
    assert check_tool_choice(tools, named("f")) == ("named", "f")


@pytest.mark.parametrize("schema", [{"type": "string"}, {"type": ["object", "null"]}])
def test_parameters_are_an_object(schema: dict[str, Any]) -> None:
    with pytest.raises(ValidationError, match="type 'object'"):
        FunctionDef(name="f", parameters=schema)


def test_lone_surrogate_refused() -> None:
    with pytest.raises(ValidationError, match="Unicode"):
        FunctionDef(name="f", description="\ud800")


# -- the prompt and the history ---------------------------------------------------------------


def test_tools_prompt_prepended() -> None:
    p = plan([{"role": "user", "content": "Weather in Paris?"}], TOOLS, "auto")
    assert [m["role"] for m in p.messages] == ["system", "user"]
    system = p.messages[0]["content"]
    listed = system.split("<tools>\n")[1].split("\n</tools>")[0].splitlines()
    assert [json.loads(line) for line in listed] == [
        {
            "type": "function",
            "function": {"name": "get_weather", "description": "The weather in a city", "parameters": WEATHER},
        },
        {"type": "function", "function": {"name": "now", "parameters": NO_ARGUMENTS}},
    ]
    assert '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>' in system
    assert "one or more functions" in system
    assert p.messages[1] == {"role": "user", "content": "Weather in Paris?"}


@pytest.mark.parametrize("role", ["system", "developer"])
def test_tools_prompt_merged_in_front_of_the_system_message(role: str) -> None:
    p = plan([{"role": role, "content": "Be brief."}, {"role": "user", "content": "hi"}], TOOLS, "auto")
    assert [m["role"] for m in p.messages] == ["system", "user"]
    system = p.messages[0]["content"]
    assert system.startswith("# Tools\n") and "<tools>" in system
    assert system.endswith("</tool_call>\n\nBe brief.")


def test_no_prompt_when_tools_are_off() -> None:
    history = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    for tools, choice in ((TOOLS, "none"), (None, None), ([], "auto")):
        p = plan(history, tools, choice)
        assert p.mode == "none" and p.messages == history and p.json_schema is None
    assert plan(history, TOOLS, "none").messages is not history  # a copy: the caller's stays as it was


def test_prompt_tells_each_mode_its_answer() -> None:
    user = [{"role": "user", "content": "hi"}]
    assert "at most one function" in plan(user, TOOLS, "auto", parallel_tool_calls=False).messages[0]["content"]
    required = plan(user, TOOLS, "required").messages[0]["content"]
    assert "must call at least one function" in required and '"parameters": <args-json-object>' in required
    one = plan(user, TOOLS, named("get_weather")).messages[0]["content"]
    assert "must call the function `get_weather`" in one and "<tools>" in one


def test_history_with_calls_and_results() -> None:
    history = [
        {"role": "user", "content": "Weather in Paris and the time?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_a",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'},
                },
                {"id": "call_b", "type": "function", "function": {"name": "now", "arguments": "{}"}},
            ],
        },
        {"role": "tool", "tool_call_id": "call_a", "content": "18 C"},
        {"role": "tool", "tool_call_id": "call_b", "content": "12:00"},
        {
            "role": "assistant",
            "content": "Checking once more.",
            "tool_calls": [
                {"id": "call_c", "type": "function", "function": {"name": "now", "arguments": "not json"}},
            ],
        },
        {"role": "tool", "tool_call_id": "call_c", "content": "12:01"},
        {"role": "user", "content": "Thanks"},
    ]
    rendered = plan(history, TOOLS, "auto").messages[1:]
    assert rendered == [
        {"role": "user", "content": "Weather in Paris and the time?"},
        {
            "role": "assistant",
            "content": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>',
        },
        {
            "role": "user",
            "content": "<tool_response>\n18 C\n</tool_response>\n<tool_response>\n12:00\n</tool_response>",
        },
        {
            "role": "assistant",
            "content": 'Checking once more.\n<tool_call>\n{"name": "now", "arguments": "not json"}\n</tool_call>',
        },
        {"role": "user", "content": "<tool_response>\n12:01\n</tool_response>"},
        {"role": "user", "content": "Thanks"},
    ]
    # Rendered the same way when the client has switched tools off for this turn.
    assert plan(history, TOOLS, "none").messages == rendered


# -- the schemas the engine enforces ----------------------------------------------------------


def test_named_schema_is_the_arguments() -> None:
    p = plan([], TOOLS, named("get_weather"))
    assert (p.mode, p.function) == ("named", "get_weather")
    assert json.loads(p.json_schema or "") == WEATHER
    assert json.loads(plan([], TOOLS, named("now")).json_schema or "") == NO_ARGUMENTS
    untyped = tool("f", {"properties": {"a": {"type": "integer"}}})
    assert json.loads(plan([], [untyped], named("f")).json_schema or "")["type"] == "object"


def _branch(name: str, parameters: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"name": {"type": "string", "enum": [name]}, "parameters": parameters},
        "required": ["name", "parameters"],
    }


def test_required_schema_is_vllms() -> None:
    p = plan([], TOOLS, "required")
    assert (p.mode, p.function) == ("required", None)
    expected = {
        "type": "array",
        "minItems": 1,
        "items": {"anyOf": [_branch("get_weather", WEATHER), _branch("now", NO_ARGUMENTS)]},
    }
    assert json.loads(p.json_schema or "") == expected
    one = json.loads(plan([], TOOLS, "required", parallel_tool_calls=False).json_schema or "")
    assert one == {**expected, "maxItems": 1}
    assert plan([], TOOLS, "auto").json_schema is None


def _resolve(root: Any, ref: str) -> Any:
    node = root
    for part in ref[2:].split("/") if ref != "#" else ():
        node = node[part]
    return node


def test_required_schema_keeps_references_resolvable() -> None:
    """xgrammar resolves `$ref` from the root, through objects only: a function's own
    "#/$defs/P" is re-pointed at a copy of its schema under the root's `$defs`."""
    tree = {
        "type": "object",
        "$defs": {"P": {"type": "integer", "enum": [7]}},
        "properties": {"a": {"$ref": "#/$defs/P"}, "kid": {"$ref": "#"}},
        "required": ["a"],
    }
    schema = json.loads(plan([], [tool("now"), tool("tree", tree)], "required").json_schema or "")
    assert set(schema["$defs"]) == {"tool_1"}  # only the function with references
    params = schema["items"]["anyOf"][1]["properties"]["parameters"]
    assert params["properties"]["a"] == {"$ref": "#/$defs/tool_1/$defs/P"}
    assert params["properties"]["kid"] == {"$ref": "#/$defs/tool_1"}
    assert _resolve(schema, "#/$defs/tool_1/$defs/P") == {"type": "integer", "enum": [7]}
    assert _resolve(schema, "#/$defs/tool_1") == params
    assert tree["properties"]["a"] == {"$ref": "#/$defs/P"}  # the request's own schema unchanged


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


# -- the real library: the schemas compile and are enforced -----------------------------------


def _conforms(value: Any, schema: Any, root: Any) -> bool:
    """The parts of JSON Schema the schemas here use."""
    if schema is True:
        return True
    if "$ref" in schema:
        return _conforms(value, _resolve(root, schema["$ref"]), root)
    if "anyOf" in schema and not any(_conforms(value, s, root) for s in schema["anyOf"]):
        return False
    if "enum" in schema and value not in schema["enum"]:
        return False
    kinds = {"object": dict, "array": list, "string": str, "number": (int, float), "integer": int}
    if "type" in schema and not isinstance(value, kinds[schema["type"]]):
        return False
    if isinstance(value, dict):
        props = schema.get("properties", {})
        if not set(schema.get("required", ())) <= set(value):
            return False
        if schema.get("additionalProperties") is False and not set(value) <= set(props):
            return False
        return all(_conforms(v, props.get(k, True), root) for k, v in value.items())
    if isinstance(value, list):
        if not schema.get("minItems", 0) <= len(value) <= schema.get("maxItems", len(value)):
            return False
        return all(_conforms(v, schema.get("items", True), root) for v in value)
    return True


MAX_NEW_TOKENS = 150


def test_real_library_enforces_the_schemas(smol: Path) -> None:
    """OpenVINO GenAI's structured output (xgrammar) on the engine's own pipeline: every schema
    `plan` writes compiles, and the greedy answers of SmolLM2-135M under it conform and parse
    into calls. Enum, anyOf, minItems/maxItems, nested objects, required/additionalProperties
    and re-pointed `$ref`s are all in these schemas. (A schema xgrammar refuses would raise in
    `step()` and break the pipeline for good: `FunctionDef` refuses those, see REFUSED.)"""
    import openvino_genai as ov_genai

    from services.engine.core import build_pipeline

    tree = {
        "type": "object",
        "$defs": {"Unit": {"type": "string", "enum": ["c", "f"]}},
        "properties": {"unit": {"$ref": "#/$defs/Unit"}},
        "required": ["unit"],
        "additionalProperties": False,
    }
    tools = [*TOOLS, tool("units", tree)]
    ask = [{"role": "user", "content": "What is the weather in Paris? And what time is it?"}]
    plans = [
        plan(ask, tools, named("get_weather")),
        plan(ask, tools, named("units")),
        plan(ask, tools, "required"),
        plan(ask, tools, "required", parallel_tool_calls=False),
    ]
    pipe = build_pipeline(str(smol), "CPU", threads=2)
    tok = ov_genai.Tokenizer(str(smol))
    handles = []
    for i, p in enumerate(plans):
        prompt = tok.encode(tok.apply_chat_template(p.messages, add_generation_prompt=True)).input_ids
        config = ov_genai.GenerationConfig()
        config.max_new_tokens, config.do_sample = MAX_NEW_TOKENS, False
        config.set_eos_token_id(2)
        structured = ov_genai.StructuredOutputConfig()
        structured.json_schema = p.json_schema
        config.structured_output_config = structured
        handles.append((pipe.add_request(i, prompt, config), []))
    while pipe.has_non_finished_requests():
        pipe.step()
        for handle, tokens in handles:
            if handle.can_read():
                for out in handle.read().values():
                    tokens += list(out.generated_ids)
    for p, (_, tokens) in zip(plans, handles, strict=True):
        text = tok.decode(tokens)
        schema = json.loads(p.json_schema or "")
        content, calls = parse(text, p, make_id())
        if p.mode == "required":
            items = _complete_items(text)
            assert items and all(_conforms(item, schema["items"], schema) for item in items), text
        if len(tokens) == MAX_NEW_TOKENS:
            # Cut short: SmolLM2-135M repeats {"name": "now", ...} until the limit when any
            # number of calls is allowed. Every item it finished conformed; the answer is text.
            assert p.mode == "required" and p.parallel and (content, calls) == (text, []), (p.mode, text)
            continue
        assert _conforms(json.loads(text), schema, schema), (p.mode, text)
        assert content is None and calls, (p.mode, text)
        if p.mode == "named":
            assert [c["function"]["name"] for c in calls] == [p.function]
        if not p.parallel:
            assert len(calls) == 1


def _complete_items(text: str) -> list[Any]:
    """The items of a JSON array that are whole, though the array may be cut short."""
    decoder, items, i = json.JSONDecoder(), [], text.index("[") + 1
    while True:
        i += len(text[i:]) - len(text[i:].lstrip(" \t\r\n,"))
        try:
            item, i = decoder.raw_decode(text, i)
        except ValueError:
            return items
        items.append(item)


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

"""OpenAI function calling (`tools`, `tool_choice`, `parallel_tool_calls`) for models whose chat
template knows only role and content (SmolLM2's ChatML has no tools support).

The tools are described to the model in the Hermes/Qwen2.5 format, which the template then
renders as plain text: a system prompt listing the tools as JSON inside `<tools></tools>`,
past calls as `<tool_call>{json}</tool_call>` in the assistant's content, and tool results as
a user message of `<tool_response>` blocks. The answer is read back the same way:

- "auto": the model writes prose and/or `<tool_call>` blocks, parsed afterwards (nothing is
  enforced: a block that does not parse stays in the content as text, never lost);
- "required" and a named function: the engine enforces a JSON Schema (OpenVINO GenAI's
  xgrammar-backed structured output), vLLM's way: the array of `{"name", "parameters"}` for
  "required", the named function's arguments object alone for a named one;
- "none": the tools are not shown and the text is the answer.

Pure: no I/O, so the gateway calls it inline and tests drive it with strings.
"""

from __future__ import annotations

import copy
import json
import re
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from services.gateway.guides import is_local_ref, schema_nodes, schema_problem

Mode = Literal["none", "auto", "required", "named"]
MakeId = Callable[[], str]
Parsed = tuple[str | None, list[dict[str, Any]]]
"""(content, tool_calls): the answer's text and its calls in OpenAI's shape."""

NO_ARGUMENTS: dict[str, Any] = {"type": "object", "properties": {}}
"""A function's `parameters` when it declares none (OpenAI: a function without arguments)."""

CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"


def new_call_id() -> str:
    """An id in OpenAI's shape (`call_` and 24 characters)."""
    return f"call_{uuid.uuid4().hex[:24]}"


# -- the schemas the engine is given ----------------------------------------------------------


def _moved_refs(schema: dict[str, Any], prefix: str) -> dict[str, Any]:
    """A copy of `schema` whose local `$ref`s point into it where it lies at `prefix` of a larger
    document ("#/$defs/P" -> prefix + "/$defs/P")."""
    moved = copy.deepcopy(schema)
    for node in schema_nodes(moved):
        if is_local_ref(node.get("$ref")):
            node["$ref"] = prefix + node["$ref"][1:]
    return moved


# -- request types ----------------------------------------------------------------------------


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    """A JSON Schema of the arguments object; None: the function takes no arguments."""
    strict: bool | None = None
    """Accepted; arguments are enforced for "required" and a named choice either way, and in
    "auto" not at all."""

    @field_validator("parameters")
    @classmethod
    def _an_object(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        # OpenAI's rule too. The rest of the schema is checked only where the engine is to
        # enforce it (`check_tool_choice`): in "auto" nothing reads it but the model.
        if v is not None and v.get("type", "object") != "object":
            raise ValueError(f"parameters must be a JSON Schema of type 'object', got type {v['type']!r}")
        return v

    @model_validator(mode="after")
    def _unicode(self) -> FunctionDef:
        # Its JSON goes into the prompt: a lone surrogate would fail in the tokenizer later.
        try:
            json.dumps(self.shown(), ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError("must be valid Unicode text (a lone surrogate \\ud800-\\udfff is not)") from None
        return self

    def arguments_schema(self) -> dict[str, Any]:
        """What the arguments must be: `parameters`, an object whether or not it says so."""
        if self.parameters is None:
            return dict(NO_ARGUMENTS)
        return {"type": "object", **self.parameters}

    def shown(self) -> dict[str, Any]:
        """The function as the model is told about it."""
        shown: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            shown["description"] = self.description
        shown["parameters"] = self.parameters if self.parameters is not None else NO_ARGUMENTS
        return shown


class Tool(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["function"]
    function: FunctionDef


_CHOICE_SHAPE = (
    "tool_choice must be 'none', 'auto', 'required' or "
    '{"type": "function", "function": {"name": "<a function in tools>"}}'
)


def check_tool_choice(tools: Sequence[Tool] | None, tool_choice: Any) -> tuple[Mode, str | None]:
    """The mode a request asks for, and the function's name for a named choice; ValueError (a
    400) when it cannot be served: a bad shape, a function not in `tools`, or a schema to
    enforce that the engine would refuse (`schema_problem`). No choice means OpenAI's default:
    "auto" with tools, "none" without; "auto" without tools is "none" too."""
    mode, name = _choice(tools, tool_choice)
    for i, tool in enumerate(tools or ()):
        if mode == "required" or (mode == "named" and tool.function.name == name):
            at = f"tools[{i}].function.parameters"
            problem = schema_problem(tool.function.arguments_schema(), at)
            if problem:
                asked = "'required'" if mode == "required" else f"naming {name!r}"
                raise ValueError(f"{problem}: the engine cannot enforce it, as tool_choice {asked} would have it")
    return mode, name


def _choice(tools: Sequence[Tool] | None, tool_choice: Any) -> tuple[Mode, str | None]:
    if isinstance(tool_choice, BaseModel):
        tool_choice = tool_choice.model_dump()
    names = [t.function.name for t in tools or ()]
    if tool_choice is None:
        return ("auto" if names else "none"), None
    if tool_choice in ("none", "auto"):
        return ("auto" if names and tool_choice == "auto" else "none"), None
    if tool_choice == "required":
        if not names:
            raise ValueError("tool_choice 'required' needs at least one function in `tools`")
        return "required", None
    name = _named(tool_choice)
    if name is None:
        raise ValueError(_CHOICE_SHAPE)
    if name not in names:
        known = ", ".join(names) if names else "none: `tools` is empty"
        raise ValueError(f"tool_choice names function {name!r}, which is not in `tools` (declared: {known})")
    return "named", name


def _named(choice: Any) -> str | None:
    if not isinstance(choice, dict) or choice.get("type") != "function":
        return None
    function = choice.get("function")
    name = function.get("name") if isinstance(function, dict) else None
    return name if isinstance(name, str) else None


# -- the plan: prompt and schema --------------------------------------------------------------


@dataclass(frozen=True)
class ToolPlan:
    messages: list[dict[str, Any]]
    """The history: role/content only, tools and calls rendered into the text; or, for a
    template that renders tools (`native`), in OpenAI's shape for the template to render."""
    mode: Mode
    function: str | None = None
    """The named function ("named" only)."""
    json_schema: str | None = None
    """What the engine enforces ("required" and "named"), as the text of a JSON Schema."""
    names: frozenset[str] = field(default_factory=frozenset)
    """The declared functions: a call of any other stays text."""
    parallel: bool = True
    template_tools: list[dict[str, Any]] | None = None
    """The tools for the chat template to show ("auto" on a template that renders tools)."""
    bare_json: bool = False
    """The template asks for calls as a bare JSON object (Llama 3.1's), not `<tool_call>`
    blocks: an answer that is one is read by the library's `Llama3JsonToolParser`."""


def plan(
    messages: list[dict[str, Any]],
    tools: Sequence[Tool] | None,
    tool_choice: Any,
    parallel_tool_calls: bool = True,
    native: bool = False,
    bare_json: bool = False,
) -> ToolPlan:
    """`native`: the model's template renders tools and calls itself. Then, for "auto", the
    template shows the tools in the format the model was trained on and the history goes to it
    as OpenAI sends it; "required" and a named function still tell the model the one answer
    shape the engine enforces (the template's own instructions would ask for another)."""
    mode, function = check_tool_choice(tools, tool_choice)
    tools = list(tools or ())
    if native:
        history = native_history(messages)
        if mode == "auto":
            shown = [{"type": "function", "function": t.function.shown()} for t in tools]
            return ToolPlan(
                messages=history,
                mode=mode,
                names=frozenset(t.function.name for t in tools),
                parallel=parallel_tool_calls,
                template_tools=shown,
                bare_json=bare_json,
            )
    prompt = system_prompt(tools, mode, function, parallel_tool_calls) if mode != "none" else None
    schema: dict[str, Any] | None = None
    if mode == "named":
        schema = next(t.function for t in tools if t.function.name == function).arguments_schema()
    elif mode == "required":
        schema = required_schema(tools, parallel_tool_calls)
    return ToolPlan(
        messages=_with_prompt(history, prompt) if native else render(messages, prompt),
        mode=mode,
        function=function,
        json_schema=json.dumps(schema, ensure_ascii=False) if schema is not None else None,
        names=frozenset(t.function.name for t in tools),
        parallel=parallel_tool_calls,
    )


def required_schema(tools: Sequence[Tool], parallel: bool = True) -> dict[str, Any]:
    """vLLM's schema for "required": a non-empty array of `{"name", "parameters"}`, one branch
    per function. A function whose schema has local `$ref`s also gets a copy under the root's
    `$defs` for them to point into: xgrammar resolves a reference through objects only, so
    "#/$defs/P" cannot stay relative to a schema nested in `anyOf`'s array."""
    branches, defs = [], {}
    for i, tool in enumerate(tools):
        params = tool.function.arguments_schema()
        if any(is_local_ref(node.get("$ref")) for node in schema_nodes(params)):
            defs[f"tool_{i}"] = params = _moved_refs(params, f"#/$defs/tool_{i}")
        branches.append(
            {
                "type": "object",
                "properties": {"name": {"type": "string", "enum": [tool.function.name]}, "parameters": params},
                "required": ["name", "parameters"],
            }
        )
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": branches}}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


_ANSWER = {
    "auto": (
        "For each function call, return a json object with function name and arguments within "
        f"{CALL_OPEN}{CALL_CLOSE} XML tags:\n{CALL_OPEN}\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n' + CALL_CLOSE
    ),
    "required": (
        "Answer with a JSON array of the function calls to make, each a json object with "
        "function name and parameters:\n"
        '[{"name": <function-name>, "parameters": <args-json-object>}]'
    ),
    "named": ("Answer with the arguments of the function `{function}` as a JSON object: <args-json-object>"),
}


def system_prompt(tools: Sequence[Tool], mode: Mode, function: str | None, parallel: bool) -> str:
    """Qwen2.5's tools prompt (Hermes' format), its answer format told per mode: "required" and a
    named choice are held to JSON by the engine, and a model told the same shape follows it
    with arguments that make sense."""
    if mode == "named":
        ask = f"You must call the function `{function}`."
    elif mode == "required":
        ask = f"You must call {'at least' if parallel else 'exactly'} one function."
    else:
        ask = (
            "You may call one or more functions to assist with the user query."
            if parallel
            else "You may call at most one function to assist with the user query."
        )
    listed = "\n".join(
        json.dumps({"type": "function", "function": t.function.shown()}, ensure_ascii=False) for t in tools
    )
    answer = _ANSWER[mode].replace("{function}", function or "")
    return (
        f"# Tools\n\n{ask}\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n"
        f"<tools>\n{listed}\n</tools>\n\n{answer}"
    )


def render(messages: Sequence[dict[str, Any]], prompt: str | None = None) -> list[dict[str, str]]:
    """The history as role/content only, as Qwen2.5's template renders tools: the tools prompt
    in front of the leading system message (or as one), past calls as `<tool_call>` blocks
    after the assistant's text, and each run of tool results as one user message."""
    out: list[dict[str, str]] = []
    after_tool = False
    for message in messages:
        role = "system" if message["role"] == "developer" else message["role"]
        content = message.get("content") or ""
        if role == "tool":
            block = f"<tool_response>\n{content}\n</tool_response>"
            if after_tool:
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block})
            after_tool = True
            continue
        after_tool = False
        if role == "assistant" and message.get("tool_calls"):
            blocks = [_call_block(c) for c in message["tool_calls"]]
            content = "\n".join([content, *blocks] if content else blocks)
        out.append({"role": role, "content": content})
    return _with_prompt(out, prompt)


def native_history(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The history as a template that renders tools takes it: OpenAI's messages, "developer"
    as "system", and each past call's JSON-text arguments as the object they encode (HF
    templates write `arguments | tojson`)."""
    out: list[dict[str, Any]] = []
    for message in messages:
        m = {k: v for k, v in message.items() if v is not None}
        m["role"] = "system" if m["role"] == "developer" else m["role"]
        m["content"] = m.get("content") or ""
        if m.get("tool_calls"):
            m["tool_calls"] = [_native_call(c) for c in m["tool_calls"]]
        out.append(m)
    return out


def _native_call(call: Any) -> dict[str, Any]:
    if isinstance(call, BaseModel):
        call = call.model_dump()
    function = dict(call.get("function") or {})
    try:
        if isinstance(function.get("arguments"), str):
            function["arguments"] = json.loads(function["arguments"])
    except ValueError:
        pass  # not JSON: the template shows the string it is
    return {"id": call.get("id"), "type": "function", "function": function}


def _with_prompt(history: list[dict[str, Any]], prompt: str | None) -> list[dict[str, Any]]:
    """The tools prompt in front of the leading system message (or as one)."""
    if prompt is None:
        return history
    if history and history[0]["role"] == "system":
        first = history[0]
        return [{**first, "content": f"{prompt}\n\n{first['content']}" if first["content"] else prompt}, *history[1:]]
    return [{"role": "system", "content": prompt}, *history]


def _call_block(call: Any) -> str:
    """One past call as the model is told to write it (its JSON-text arguments as an object)."""
    if isinstance(call, BaseModel):
        call = call.model_dump()
    function = call.get("function") or {}
    arguments: Any = function.get("arguments")
    try:
        arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
    except ValueError:
        pass  # not JSON: shown as the string it is
    body = json.dumps({"name": function.get("name"), "arguments": arguments}, ensure_ascii=False)
    return f"{CALL_OPEN}\n{body}\n{CALL_CLOSE}"


# -- reading the answer -----------------------------------------------------------------------


def parse(text: str, plan: ToolPlan, make_id: MakeId = new_call_id) -> Parsed:
    """The finished text as (content, tool_calls in OpenAI's shape)."""
    if plan.mode == "none":
        return text, []
    if plan.mode == "named":
        return None, [make_call(make_id, plan.function or "", compact_json(text))]
    if plan.mode == "required":
        calls = _required_calls(text, plan)
        if calls is None:
            return text, []
        return None, [make_call(make_id, name, args) for name, args in calls]
    return _parse_auto(text, plan, make_id)


_BLOCK = re.compile(re.escape(CALL_OPEN) + r"(.*?)(?:" + re.escape(CALL_CLOSE) + r"|\Z)", re.S)


def _parse_auto(text: str, plan: ToolPlan, make_id: MakeId) -> Parsed:
    if plan.bare_json and CALL_OPEN not in text:
        call = _bare_json_call(text, plan)
        if call is not None:
            return None, [make_call(make_id, *call)]
    pieces: list[str] = []
    calls: list[dict[str, Any]] = []
    end = 0
    for block in _BLOCK.finditer(text):
        pieces.append(text[end : block.start()])
        end = block.end()
        call = block_call(block.group(1), plan)
        if call is None:
            pieces.append(block.group(0))
        elif plan.parallel or not calls:
            calls.append(make_call(make_id, *call))
    pieces.append(text[end:])
    content = "".join(pieces).strip()
    return (content or (None if calls else "")), calls


def _bare_json_call(text: str, plan: ToolPlan) -> tuple[str, str] | None:
    """A whole answer that is one call as Llama 3.1 writes it (`{"name", "parameters"}`), read
    by OpenVINO GenAI's own parser; None if it is not a call of a declared function."""
    if not text.strip().startswith("{"):
        return None
    import openvino_genai as ov_genai

    message: dict[str, Any] = {"content": text.strip()}
    try:
        ov_genai.Llama3JsonToolParser().parse(message)
    except Exception:  # the library's parse error, whatever its type: then it is content
        return None
    calls = message.get("tool_calls") or []
    if len(calls) != 1:
        return None
    return _item_call(calls[0], plan, "parameters", "arguments")


def block_call(body: str, plan: ToolPlan) -> tuple[str, str] | None:
    """(name, arguments JSON) of one `<tool_call>` block's text, or None if it is not a call of
    a declared function with an object of arguments."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    return _item_call(obj, plan, "arguments", "parameters")


def _item_call(obj: Any, plan: ToolPlan, *keys: str) -> tuple[str, str] | None:
    if not isinstance(obj, dict) or obj.get("name") not in plan.names:
        return None
    for key in keys:
        args = obj.get(key)
        if isinstance(args, str):  # some models write the arguments as JSON text
            try:
                args = json.loads(args)
            except ValueError:
                continue
        if isinstance(args, dict):
            return obj["name"], json.dumps(args, ensure_ascii=False, separators=(",", ":"))
    return None


def _required_calls(text: str, plan: ToolPlan) -> list[tuple[str, str]] | None:
    """The calls of a "required" answer, or None unless all of it is calls (it is then content:
    cut short by max_tokens, say)."""
    try:
        items = json.loads(text)
    except ValueError:
        return None
    if not isinstance(items, list) or not items:
        return None
    calls = [_item_call(item, plan, "parameters", "arguments") for item in items]
    if any(c is None for c in calls):
        return None
    return [c for c in calls if c is not None][: None if plan.parallel else 1]


def make_call(make_id: MakeId, name: str, arguments: str) -> dict[str, Any]:
    return {"id": make_id(), "type": "function", "function": {"name": name, "arguments": arguments}}


class Compactor:
    """JSON text without the whitespace between its tokens, a piece at a time (the grammar lets
    the model indent; the client gets what `json.dumps(separators=(",", ":"))` would write)."""

    def __init__(self) -> None:
        self._in_string = False
        self._escaped = False

    def __call__(self, text: str) -> str:
        out = []
        for ch in text:
            if self._in_string:
                out.append(ch)
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch == '"':
                    self._in_string = False
            elif ch not in " \t\n\r":
                out.append(ch)
                self._in_string = ch == '"'
        return "".join(out)


def compact_json(text: str) -> str:
    return Compactor()(text)

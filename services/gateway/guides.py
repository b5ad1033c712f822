"""Structured output asked for at the API, as the grammar the engine enforces (`Guide`).

OpenAI's `response_format` (`json_object`, `json_schema`) and vLLM's `structured_outputs`
(`json`, `regex`, `choice`; the older `guided_*` names too) become one `Guide` that OpenVINO
GenAI's `StructuredOutputConfig` (xgrammar) enforces token by token.

Every spec is checked here, before it is sent: a spec the library cannot compile does not
fail its own request but the pipeline's whole step, for every request on it (measured with
OpenVINO GenAI 2026.4: the step raises, and the pipeline is unusable after). So only what can
be checked is let through: JSON Schemas valid against their meta-schema with local `$ref`s
that resolve (a remote one would also make the checker fetch a URL), regexes in the subset
xgrammar converts, and choices rendered into a grammar here. A free-form EBNF `grammar` is
refused by name: nothing here can check it short of the engine's own compiler.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import jsonschema_rs

from services.gateway.tools import schema_problem
from shared.messages import Guide

ANY_OBJECT: dict[str, Any] = {"type": "object"}
"""`json_object`: any JSON object (OpenAI's JSON mode)."""

_UNSUPPORTED_REGEX = re.compile(r"\(\?(?!:)|\\[1-9]|\\[bBAZzG]|\\[pP]\{")
"""Lookaround, named or flagged groups, backreferences, anchors-by-escape and Unicode
classes: Python's `re` takes them, xgrammar's regex converter does not."""


class GuideError(ValueError):
    """A spec that cannot be enforced (the 400 names `param`)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message if message.startswith(param) else f"{param} {message}")
        self.param = param


def _plain_text(text: str, param: str) -> None:
    """Text the engine's grammar compiler takes: it reads specs as C strings (a NUL ends one
    early, and the cut spec fails to compile, for every request beside it), in UTF-8."""
    if "\x00" in text:
        raise GuideError(param, "must not contain a NUL character")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise GuideError(param, "must be valid Unicode text (a lone surrogate is not)") from None


def regex(pattern: Any, param: str) -> Guide:
    _check_regex(pattern, param)
    return Guide(kind="regex", spec=pattern)


def _check_regex(pattern: Any, param: str) -> None:
    if not isinstance(pattern, str) or not pattern:
        raise GuideError(param, "must be a non-empty regular expression")
    _plain_text(pattern, param)
    try:
        re.compile(pattern)
    except re.error as e:
        raise GuideError(param, f"is not a valid regular expression: {e}") from None
    if _UNSUPPORTED_REGEX.search(pattern):
        raise GuideError(param, "uses a regex feature structured output cannot enforce (lookaround, "
                                "group flags or names, backreferences, \\b/\\A/\\Z anchors, \\p{...})")


def choice(choices: Any, param: str) -> Guide:
    """Exactly one of `choices`, as a grammar of string literals (so no choice's text is ever
    read as regex syntax)."""
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise GuideError(param, "must be a non-empty list of non-empty strings")
    for c in choices:
        _plain_text(c, param)
    return Guide(kind="grammar", spec="root ::= " + " | ".join(_literal(c) for c in choices))


def _literal(text: str) -> str:
    escaped = text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\r", "\\r").replace("\t", "\\t")
    return f'"{escaped}"'


def json_schema(schema: Any, param: str) -> Guide:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise GuideError(param, f"is not valid JSON: {e}") from None
    if not isinstance(schema, dict):
        raise GuideError(param, "must be a JSON Schema object")
    for key, value in _walk(schema):
        if key == "$ref" and not (isinstance(value, str) and value.startswith("#")):
            raise GuideError(param, f"$ref {value!r} is not local: only references into the schema itself (#/...) are followed")
        if key == "pattern" and isinstance(value, str):
            _check_regex(value, f"{param} (pattern)")
    _plain_text(json.dumps(schema, ensure_ascii=False).replace("\\u0000", "\x00"), param)
    problem = schema_problem(schema, param)  # what xgrammar refuses though the meta-schema allows it
    if problem:
        raise GuideError(param, problem)
    try:
        jsonschema_rs.meta.validate(schema)
        jsonschema_rs.validator_for(schema)  # resolves every $ref
    except (jsonschema_rs.ValidationError, jsonschema_rs.ReferencingError, ValueError) as e:
        raise GuideError(param, f"is not a valid JSON Schema: {str(e).splitlines()[0]}") from None
    return Guide(kind="json_schema", spec=json.dumps(schema, separators=(",", ":")))


def _walk(node: Any) -> Iterator[tuple[str, Any]]:
    if isinstance(node, dict):
        for key, value in node.items():
            yield key, value
            yield from _walk(value)
    elif isinstance(node, list):
        for item in node:
            yield from _walk(item)


def response_format(value: dict[str, Any] | None) -> Guide | None:
    """OpenAI's `response_format`: text (none), `json_object`, or `json_schema`."""
    if not value:
        return None
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return json_schema(ANY_OBJECT, "response_format")
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise GuideError("response_format", "json_schema needs `json_schema: {name, schema, strict}`")
        return json_schema(spec["schema"], "response_format.json_schema.schema")
    raise GuideError("response_format", f"type {kind!r} is not one of text, json_object, json_schema")


_STRUCTURED = ("json", "regex", "choice", "grammar", "json_object")
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def structured_outputs(value: dict[str, Any] | None, guided: dict[str, Any]) -> Guide | None:
    """vLLM's `structured_outputs` ({json | regex | choice | grammar | json_object}), or its
    older `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar` fields."""
    asked = {k: v for k, v in (value or {}).items() if k in _STRUCTURED and v not in (None, False)}
    param = {k: f"structured_outputs.{k}" for k in asked}
    for name, kind in _GUIDED.items():
        if guided.get(name) is not None:
            asked[kind], param[kind] = guided[name], name
    if len(asked) > 1:
        raise GuideError("structured_outputs", f"give one of {', '.join(sorted(param.values()))}, not several")
    if not asked:
        return None
    (kind, spec), = asked.items()
    if kind == "json":
        return json_schema(spec, param[kind])
    if kind == "json_object":
        return json_schema(ANY_OBJECT, param[kind])
    if kind == "regex":
        return regex(spec, param[kind])
    if kind == "choice":
        return choice(spec, param[kind])
    raise GuideError(param[kind], "a free-form grammar is not supported: it cannot be checked before it "
                                  "reaches the engine, where one that fails to compile fails every request "
                                  "beside it; use json, regex or choice")

"""Structured output asked for at the API, as the grammar the engine enforces (`Guide`).

OpenAI's `response_format` (`json_object`, `json_schema`) and vLLM's `structured_outputs`
(`json`, `regex`, `choice`; the older `guided_*` names too) become one `Guide` that OpenVINO
GenAI's `StructuredOutputConfig` (xgrammar) enforces token by token.

Every spec is checked here, before it is sent: a spec the library cannot compile does not
fail its own request but the pipeline's whole step, for every request on it (measured with
OpenVINO GenAI 2026.4: the step raises, and the pipeline is unusable after). So only what can
be checked is let through: JSON Schemas valid against their meta-schema with local `$ref`s
that resolve (a remote one would also make the checker fetch a URL), regexes in the subset
xgrammar converts, choices rendered into a grammar here, and EBNF grammars that `ebnf.py`
finds the compiler reads (only reading fails that way: measured, see there).
"""

from __future__ import annotations

import json
import re
import warnings
from collections.abc import Iterator
from typing import Any, TypeGuard

import jsonschema_rs

from services.gateway import ebnf
from shared.messages import Guide

ANY_OBJECT: dict[str, Any] = {"type": "object"}
"""`json_object`: any JSON object (OpenAI's JSON mode)."""


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
    problem = regex_problem(pattern)
    if problem:
        raise GuideError(param, problem)


def choice(choices: Any, param: str) -> Guide:
    """Exactly one of `choices`, as a grammar of string literals (so no choice's text is ever
    read as regex syntax)."""
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise GuideError(param, "must be a non-empty list of non-empty strings")
    for c in choices:
        _plain_text(c, param)
    return Guide(kind="grammar", spec="root ::= " + " | ".join(_literal(c) for c in choices))


def _literal(text: str) -> str:
    escaped = (
        text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\r", "\\r").replace("\t", "\\t")
    )
    return f'"{escaped}"'


def json_schema(schema: Any, param: str) -> Guide:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise GuideError(param, f"is not valid JSON: {e}") from None
    if not isinstance(schema, dict):
        raise GuideError(param, "must be a JSON Schema object")
    _plain_text(json.dumps(schema, ensure_ascii=False).replace("\\u0000", "\x00"), param)
    for node in schema_nodes(schema):
        ref = node.get("$ref")
        if isinstance(ref, str) and not is_local_ref(ref):  # also: the checker below would fetch it
            raise GuideError(
                param, f"$ref {ref!r} is not local: only references into the schema itself (#/...) are followed"
            )
    problem = schema_problem(schema, param)  # what xgrammar refuses though the meta-schema allows it
    if problem:
        raise GuideError(param, problem)
    try:
        jsonschema_rs.meta.validate(schema)
        jsonschema_rs.validator_for(schema)  # resolves every $ref
    except (jsonschema_rs.ValidationError, jsonschema_rs.ReferencingError, ValueError) as e:
        raise GuideError(param, f"is not a valid JSON Schema: {str(e).splitlines()[0]}") from None
    return Guide(kind="json_schema", spec=json.dumps(schema, separators=(",", ":")))


# -- what xgrammar refuses (measured with OpenVINO GenAI 2026.4) ---------------------------------

JSON_TYPES = frozenset({"string", "number", "integer", "boolean", "object", "array", "null"})
SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
SCHEMA_ONE = (
    "additionalProperties",
    "items",
    "not",
    "contains",
    "propertyNames",
    "if",
    "then",
    "else",
    "additionalItems",
    "unevaluatedProperties",
    "unevaluatedItems",
)
SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_BOUNDS = (("minItems", "maxItems"), ("minLength", "maxLength"), ("minProperties", "maxProperties"))
_UNSUPPORTED_ESCAPES = frozenset("123456789bBpPAZzG")
"""Back-references, word boundaries, anchors-by-escape and Unicode classes: xgrammar's regex
converter refuses them (as it does lookaround, named groups and inline flags: `(?` other than
`(?:`)."""


def schema_problem(schema: Any, at: str = "parameters") -> str | None:
    """What xgrammar would refuse in a schema the engine is to enforce, or None.

    A schema the engine's grammar compiler refuses fails inside `ContinuousBatchingPipeline.step`
    and leaves the pipeline unusable for every request in it (measured with OpenVINO GenAI
    2026.4: each later step raises "cannot be called when we are already in scheduling
    phase"), so such a schema must be a 400 before it gets there. This checks what was
    measured to be refused (an unknown `type`, a `$ref` that does not resolve, `items` as a
    list, an empty `enum` or `anyOf`, a non-integer or contradictory `minItems`/`maxItems`, a
    `pattern` with lookaround or `\\b`, ...), not all of JSON Schema; keywords xgrammar
    ignores (`not`, `multipleOf`, `uniqueItems`, `if`) pass, unenforced."""
    if not isinstance(schema, dict):
        return f"{at} must be a JSON Schema object"
    return next(_problems(schema, schema, at), None)


def _problems(node: Any, root: dict[str, Any], at: str) -> Iterator[str]:
    if isinstance(node, bool):  # true / false: anything / nothing
        return
    if not isinstance(node, dict):
        yield f"{at} must be a JSON Schema (an object or a boolean)"
        return
    yield from _node_problems(node, root, at)
    for key in SCHEMA_MAPS:
        if key in node:
            if not isinstance(node[key], dict):
                yield f"{at}.{key} must be an object"
                continue
            for name, sub in node[key].items():
                yield from _problems(sub, root, f"{at}.{key}.{name}")
    for key in SCHEMA_ONE:
        if key in node:
            if key == "items" and isinstance(node[key], list):
                yield f"{at}.items must be a schema, not a list (use prefixItems)"
                continue
            yield from _problems(node[key], root, f"{at}.{key}")
    for key in SCHEMA_LISTS:
        if key in node:
            if not isinstance(node[key], list) or not node[key]:
                yield f"{at}.{key} must be a non-empty array"
                continue
            for i, sub in enumerate(node[key]):
                yield from _problems(sub, root, f"{at}.{key}[{i}]")


def _node_problems(node: dict[str, Any], root: dict[str, Any], at: str) -> Iterator[str]:
    """The keywords of one schema node itself (its subschemas are `_problems`'s)."""
    if "type" in node:
        types = node["type"] if isinstance(node["type"], list) else [node["type"]]
        if not types or not all(isinstance(t, str) and t in JSON_TYPES for t in types):
            yield (f"{at}.type must be one of {sorted(JSON_TYPES)} or a list of them, got {node['type']!r}")
    ref = node.get("$ref")
    if ref is not None and not isinstance(ref, str):
        yield f"{at}.$ref must be a string"
    elif is_local_ref(ref) and not _resolves(root, ref):
        yield f"{at}.$ref {ref!r} does not point to a schema in parameters (e.g. '#/$defs/Name')"
    if "required" in node and not (
        isinstance(node["required"], list) and all(isinstance(r, str) for r in node["required"])
    ):
        yield f"{at}.required must be an array of property names"
    if "enum" in node and not (isinstance(node["enum"], list) and node["enum"]):
        yield f"{at}.enum must be a non-empty array"
    for low, high in _BOUNDS:
        for key in (low, high):
            if key in node and not (type(node[key]) is int and node[key] >= 0):
                yield f"{at}.{key} must be a non-negative integer"
        if type(node.get(low)) is int and type(node.get(high)) is int and node[low] > node[high]:
            yield f"{at}.{low} is greater than {high}"
    if "pattern" in node:
        yield from _pattern_problems(node["pattern"], at)


def _pattern_problems(pattern: Any, at: str) -> Iterator[str]:
    if not isinstance(pattern, str):
        yield f"{at}.pattern must be a string"
        return
    problem = regex_problem(pattern)
    if problem:
        yield f"{at}.pattern {problem}"


def regex_problem(pattern: str) -> str | None:
    """What keeps xgrammar from converting a regex (or Python's `re` from reading it), or None."""
    try:
        with warnings.catch_warnings():  # `re`'s FutureWarnings on `[[` or `--` are not the client's error
            warnings.simplefilter("ignore", FutureWarning)
            re.compile(pattern)
    except re.error as e:
        return f"is not a valid regular expression: {e}"
    return _unsupported_regex(pattern)


_REPEAT = re.compile(r"\{(\d+)(,(\d*))?\}")


def _unsupported_regex(pattern: str) -> str | None:
    """Walked as xgrammar reads a regex: escapes, classes (where `{` is a character) and, outside
    them, `(?` groups, `{`, alternatives and quantifiers. Measured, xgrammar refuses what
    Python's `re` reads here, and a refused regex fails the pipeline's step for every request:
    a `{` that starts no count, an empty alternative before a `|` (or last, outside a group;
    anchors are no element: `^|a` is refused), and a possessive quantifier (`a?+`)."""
    i, in_class = 0, False
    empty = [True]  # per open group: whether its current alternative has no element yet
    while i < len(pattern):
        ch = pattern[i]
        if ch == "\\":
            if pattern[i + 1 : i + 2] in _UNSUPPORTED_ESCAPES:
                return "uses what structured output cannot enforce (a back-reference, \\b, \\A/\\Z anchors or \\p{...})"
            empty[-1] = False
            i += 2
            continue
        if in_class:
            in_class = ch != "]"
            i += 1
            continue
        end = i + 1
        if ch == "[":
            if pattern.startswith(("[]", "[^]"), i):  # xgrammar ends the class there; `re` reads a `]`
                return "has a character class that starts with `]`: write `\\]` for the character"
            in_class, empty[-1] = True, False
        elif pattern.startswith("(?", i) and not pattern.startswith("(?:", i):
            return "uses what structured output cannot enforce (lookaround, a named group or an inline flag)"
        elif ch == "(":
            empty.append(True)
            end = i + 3 if pattern.startswith("(?:", i) else i + 1
        elif ch == ")":
            if len(empty) > 1:
                empty.pop()
            empty[-1] = False
        elif ch == "|":
            if empty[-1]:
                return "has an empty alternative before a `|`: structured output cannot enforce it"
        elif ch in "*+?{":
            if ch == "{":
                m = _REPEAT.match(pattern, i)
                if m is None:
                    return "has a `{` that starts no repetition count: write `\\{` for the character"
                if m.group(3) and int(m.group(1)) > int(m.group(3)):
                    return f"has a repetition {m.group()} whose bounds are the wrong way round"
                end = m.end()
            end += 1 if (pattern[end : end + 1] == "?" and ch != "?") or pattern[i : i + 2] == "??" else 0
            if pattern[end : end + 1] == "+":
                return "has a possessive quantifier (such as `a?+`): structured output cannot enforce it"
        elif ch in "^$":
            pass  # xgrammar strips a leading `^` and a trailing `$`, and ignores both elsewhere: no element
        else:
            empty[-1] = False
        if ch == "|":
            empty[-1] = True
        i = end
    if len(empty) == 1 and empty[0] and "|" in pattern:
        return "ends with an empty alternative: structured output cannot enforce it"
    return None


def _resolves(root: dict[str, Any], ref: str) -> bool:
    """Whether a local `$ref` names a schema, walked as xgrammar walks it: through objects only
    (no array index such as `anyOf/0`) and without `~0`/`~1` or %-escapes."""
    if ref == "#":
        return True
    if not ref.startswith("#/"):
        return False
    node: Any = root
    for part in ref[2:].split("/"):
        if "~" in part or "%" in part or not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return isinstance(node, (dict, bool))


def schema_nodes(schema: Any) -> Iterator[dict[str, Any]]:
    """Every schema object in `schema`, itself included (not the values of `enum`, `const`...)."""
    if not isinstance(schema, dict):
        return
    yield schema
    for key in SCHEMA_MAPS:
        if isinstance(schema.get(key), dict):
            for sub in schema[key].values():
                yield from schema_nodes(sub)
    for key in SCHEMA_ONE:
        yield from schema_nodes(schema.get(key))
    for key in SCHEMA_LISTS:
        if isinstance(schema.get(key), list):
            for sub in schema[key]:
                yield from schema_nodes(sub)


def is_local_ref(ref: Any) -> TypeGuard[str]:
    return isinstance(ref, str) and ref.startswith("#")


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
    ((kind, spec),) = asked.items()
    if kind == "json":
        return json_schema(spec, param[kind])
    if kind == "json_object":
        return json_schema(ANY_OBJECT, param[kind])
    if kind == "regex":
        return regex(spec, param[kind])
    if kind == "choice":
        return choice(spec, param[kind])
    return grammar(spec, param[kind])


def grammar(text: Any, param: str) -> Guide:
    """A free-form EBNF grammar in xgrammar's syntax (as vLLM's `grammar` takes it)."""
    if not isinstance(text, str) or not text.strip():
        raise GuideError(param, "must be a non-empty EBNF grammar")
    _plain_text(text, param)
    problem = ebnf.problem(text)
    if problem:
        raise GuideError(param, f"does not read as an EBNF grammar: {problem}")
    return Guide(kind="grammar", spec=text)

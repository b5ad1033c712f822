"""Structured output specs become grammars the engine can compile, or a 400 naming the
parameter: a spec its compiler refuses would fail the step of every request beside it."""

import json
import re

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from services.gateway import guides
from services.gateway.guides import GuideError
from shared.messages import Guide
from tests.unit.conftest import Refuses

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}


def test_json_schema_response_format_carries_the_schema() -> None:
    g = guides.response_format({"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON, "strict": True}})
    assert g is not None and g.kind == "json_schema" and json.loads(g.spec) == PERSON


def test_json_object_is_any_object_and_text_is_nothing() -> None:
    g = guides.response_format({"type": "json_object"})
    assert g is not None and json.loads(g.spec) == {"type": "object"}
    assert guides.response_format({"type": "text"}) is None and guides.response_format(None) is None


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "frobnicate"},
        {"$ref": "#/nope"},
        {"$ref": "http://example.com/schema.json"},
        {"type": "string", "pattern": "(?=a)b"},
        {"type": "array", "minItems": 3, "maxItems": 1},
        {"enum": []},
        {"enum": ["a\x00"]},
        "{not json",
        [1, 2],
    ],
)
def test_a_schema_the_engine_cannot_compile_is_refused(schema: object) -> None:
    with pytest.raises(GuideError) as e:
        guides.response_format({"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    assert e.value.param.startswith("response_format")


def test_structured_outputs_kinds() -> None:
    assert guides.structured_outputs({"regex": r"\d{3}"}, {}).kind == "regex"  # type: ignore[union-attr]
    assert guides.structured_outputs({"json": PERSON}, {}).kind == "json_schema"  # type: ignore[union-attr]
    assert guides.structured_outputs(None, {"guided_regex": "[a-z]+"}).kind == "regex"  # type: ignore[union-attr]
    assert guides.structured_outputs(None, {}) is None
    with pytest.raises(GuideError, match="not several"):
        guides.structured_outputs({"regex": "a"}, {"guided_json": PERSON})
    assert guides.structured_outputs({"grammar": 'root ::= "a"'}, {}) == Guide(kind="grammar", spec='root ::= "a"')
    with pytest.raises(GuideError) as e:
        guides.structured_outputs(None, {"guided_grammar": 'root ::= "a" | undefined'})
    assert e.value.param == "guided_grammar" and "undefined" in str(e.value)


def test_choice_is_a_grammar_of_literals_that_keeps_regex_characters_literal() -> None:
    g = guides.choice(['say "hi"', "a.b*", "back\\slash"], "structured_outputs.choice")
    assert g.kind == "grammar"
    literals = re.findall(r'"((?:[^"\\]|\\.)*)"', g.spec.removeprefix("root ::= "))
    assert [s.replace('\\"', '"').replace("\\\\", "\\") for s in literals] == ['say "hi"', "a.b*", "back\\slash"]
    for bad in ([], ["ok", ""], "yes", [1], ["a\x00b"], ["\ud800"]):
        with pytest.raises(GuideError):
            guides.choice(bad, "structured_outputs.choice")


@pytest.mark.parametrize("pattern", ["(unclosed", "(?=x)", "(?P<n>a)", r"(a)\1", r"\bword", r"\p{L}", "", "a\x00b"])
def test_a_regex_outside_what_the_engine_converts_is_refused(pattern: str) -> None:
    with pytest.raises(GuideError):
        guides.regex(pattern, "structured_outputs.regex")


REGEX_PIECES = [
    "a",
    "b",
    "[a-z]",
    "[{]",
    "[]{]",
    "\\d",
    "\\{",
    "\\}",
    "{",
    "}",
    "{2}",
    "{1,3}",
    "{2,}",
    "{,2}",
    "{3,1}",
    "(",
    ")",
    "(?:",
    "|",
    "*",
    "+",
    "?",
    ".",
    "^",
    "$",
    "\\w",
    "-",
    ",",
    "m",
    "1",
    "()",
    "??",
    "[^]",
]


# Derandomized: the same examples on every run, so that CI does not find a new one by chance
# (a random run found `^|a`; 6,000 random examples pass since, the counterexamples stay below).
@settings(
    max_examples=1000,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
    derandomize=True,
    database=None,
)
@given(st.lists(st.sampled_from(REGEX_PIECES), min_size=1, max_size=8).map("".join))
@example("^|a")
@example("a|$")
@example("(^|a)")
def test_a_regex_let_through_compiles_in_the_engine_library(library_refuses: Refuses, pattern: str) -> None:
    """A regex the check lets through is one xgrammar converts (one it cannot would fail the
    continuous-batching pipeline's step for every request on it: schemathesis found `{m`)."""
    if guides.regex_problem(pattern) is None:
        assert library_refuses("regex", pattern) is None, pattern

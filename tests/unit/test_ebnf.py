"""The EBNF check lets through only grammars the engine's compiler reads: held against the
compiler itself (OpenVINO GenAI's xgrammar), on grammars generated at random."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.gateway.ebnf import MAX_REPEAT, problem
from tests.unit.conftest import Refuses


@pytest.mark.parametrize(
    "text",
    [
        'root ::= "a"',
        'root ::= answer " because " reason\nanswer ::= "yes" | "no"\nreason ::= [a-z ]{3,20} "."',
        'root ::= x\nx ::= x "y" | "z"',  # left recursion reads (and is served)
        'root ::= ("a" | "b")* [^"\\\\\\x00-\\x1f]+ "\\u00e9\\n" # a comment\n# another',
        'root ::= "a" (= "b" [0-9])',
        "root ::= my-rule.x{2,}\nmy-rule.x ::= [\\]\\-]",
        'root::="a"',
    ],
)
def test_reads(text: str) -> None:
    assert problem(text) is None


@pytest.mark.parametrize(
    "text, says",
    [
        ("", "empty"),
        ('start ::= "a"', 'no rule named "root"'),
        ('root ::= "a" nowhere', "'nowhere' is used but not defined"),
        ('root ::= "a"\nroot ::= "b"', "defined twice"),
        ('root ::= "a" |', "expected an element"),
        ('root ::= "a"{3,2}', "wrong way round"),
        ('root ::= "a"{,2}', "expected int"),
        ('root ::= "a"**', "one quantifier"),
        ("root ::= [z-a]", "runs backwards"),
        ("root ::= [\\d]", "\\d is not supported"),
        ('root ::= "\\q"', "escape \\q"),
        ("root ::= 'a'", "unexpected character"),
        ('root ::= "a', 'must end with "'),
        ('root ::= "a" x ::= "b"\nx ::= "c"', "start its own line"),
        ('root ::= "a" (= "b" | "c")', "expected )"),
        ('root ::= TagDispatch(("<a>", x))\nx ::= "z"', "macros"),
        (f'root ::= "a"{{{MAX_REPEAT + 1}}}', "above"),
    ],
)
def test_refuses_with_the_reason(text: str, says: str) -> None:
    assert says in (problem(text) or "")


# -- against the compiler ------------------------------------------------------------------------

PIECES = [
    '"a"',
    '"\\n"',
    '"\\x41"',
    '"\\u00e9"',
    '""',
    '"\\q"',
    '"\\x4"',
    "'a'",
    "[a-z]",
    "[z-a]",
    '[^"\\\\]',
    "[\\d]",
    "[\\]]",
    "[-a]",
    "[a-b-c]",
    "[\\x00-\\x1f]",
    "[]",
    "[^]",
    "|",
    "(",
    ")",
    "*",
    "+",
    "?",
    "{2}",
    "{1,3}",
    "{3,1}",
    "{,2}",
    "(=",
    "\n",
    " ",
    "#c\n",
    "x",
    "root",
    "::=",
    "1",
    '"',
    "[",
    ",",
    "TagDispatch(",
]


def _element(names: list[str], depth: int = 0) -> st.SearchStrategy[str]:
    leaf = st.sampled_from(['"a"', '"\\t"', "[0-9]", '[^"]', '"\\u00e9"', '""', *names])
    kinds = [leaf, leaf, st.sampled_from(PIECES)]
    if depth < 2:
        kinds.append(_alternatives(names, depth + 1).map(lambda a: f"({a})"))
    quant = st.sampled_from(["", "", "*", "+", "?", "{2}", "{0,}", "{1,3}", "{3,1}", "**"])
    return st.tuples(st.one_of(*kinds), quant).map("".join)


def _alternatives(names: list[str], depth: int = 0) -> st.SearchStrategy[str]:
    seq = st.lists(_element(names, depth), min_size=1, max_size=3).map(" ".join)
    return st.lists(seq, min_size=1, max_size=3).map(" | ".join)


@st.composite
def grammars(draw: st.DrawFn) -> str:
    """Near-grammars: rules of well-formed bodies with, now and then, a piece that breaks them."""
    if draw(st.booleans()):
        return "root ::= " + "".join(draw(st.lists(st.sampled_from(PIECES), min_size=1, max_size=8)))
    names = ["root", *draw(st.lists(st.sampled_from(["x", "y", "my-r", "r.1"]), max_size=3, unique=True))]
    rules = [f"{n} ::= {draw(_alternatives(names))}" for n in names]
    if draw(st.booleans()):
        rules[-1] += f" (= {draw(_element(names))} {draw(_element(names))})"
    return "\n".join(rules)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(grammars())
def test_what_it_lets_through_the_compiler_reads(library_refuses: Refuses, text: str) -> None:
    if problem(text) is None:
        assert library_refuses("grammar", text) is None, text


def test_it_lets_through_what_clients_write(library_refuses: Refuses) -> None:
    """The check is not so strict that it refuses the grammars people send (vLLM's examples)."""
    for text in [
        'root ::= select_statement\nselect_statement ::= "SELECT " column " from " table " where " condition\n'
        'column ::= "col_1 " | "col_2 "\ntable ::= "table_1 " | "table_2 "\ncondition ::= column "= " number\n'
        'number ::= "1 " | "2 "',
        'root ::= "{" ws "\\"name\\":" ws string ws "}"\nstring ::= "\\"" [^"\\\\\\x00-\\x1f]* "\\""\n'
        "ws ::= [ \\t\\n]*",
    ]:
        assert problem(text) is None and library_refuses("grammar", text) is None

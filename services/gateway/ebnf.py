"""Whether the engine's grammar compiler (xgrammar, inside OpenVINO GenAI) reads an EBNF grammar.

A grammar it cannot read fails inside `ContinuousBatchingPipeline.step()`, for every request
on the pipeline, and leaves the pipeline unusable (measured, OpenVINO GenAI 2026.4). Measured
the same way, only reading fails that way: a grammar that reads but matches nothing, recurses
on the left, or repeats a string thousands of times is served (its request just ends early).
So this checks the reading alone, and lets through only the part of xgrammar's EBNF whose
reading it can vouch for (`tests/unit/test_ebnf.py` holds it against the library itself):

    rule       ::= NAME "::=" alternatives lookahead?     (a rule starts its line)
    alternatives ::= sequence ("|" sequence)*
    sequence   ::= (element quantifier?)+
    element    ::= STRING | CLASS | NAME | "(" alternatives ")"
    quantifier ::= "*" | "+" | "?" | "{" INT ("," INT?)? "}"
    lookahead  ::= "(=" sequence ")"

with `root` defined, every name defined once and every used name defined; `#` comments.
Newer xgrammar syntax (rule attributes, `TagDispatch(...)` and other macros) is refused by
name rather than guessed at: the library's version decides what it reads.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_NAME = re.compile(r"[A-Za-z_.\-][A-Za-z0-9_.\-]*")
_INT = re.compile(r"[0-9]+")
_STRING_ESCAPES = set("ntrabfv0\\\"'")
_CLASS_ESCAPES = _STRING_ESCAPES | set("^$.*+?()[]{}|/-")
_HEX_ESCAPES = {"x": 2, "u": 4, "U": 8}
_C_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "a": "\a", "b": "\b", "f": "\f", "v": "\v", "0": "\0"}
MAX_REPEAT = 10_000
"""Repetition bounds beyond this are refused: the compiler reads larger ones, but nothing a
client means needs them, and the compiled grammar grows with them."""


class EbnfError(ValueError):
    """Where and why the grammar does not read (1-based line and column, as xgrammar says it)."""


@dataclass(frozen=True)
class Token:
    kind: str  # name, string, class, int, or the punctuation itself
    text: str
    line: int
    column: int


def problem(text: str) -> str | None:
    """Why the engine's compiler would not read `text`, or None."""
    try:
        _Parser(_tokens(text)).grammar()
    except EbnfError as e:
        return str(e)
    return None


class _Lexer:
    def __init__(self, text: str) -> None:
        self.text, self.pos, self.line, self.column = text, 0, 1, 1

    def peek(self, delta: int = 0) -> str:
        i = self.pos + delta
        return self.text[i] if i < len(self.text) else ""

    def take(self, count: int = 1) -> str:
        out = self.text[self.pos : self.pos + count]
        for ch in out:
            self.line, self.column = (self.line + 1, 1) if ch == "\n" else (self.line, self.column + 1)
        self.pos += len(out)
        return out

    def fail(self, message: str) -> EbnfError:
        return EbnfError(f"line {self.line}, column {self.column}: {message}")

    def skip_space(self) -> None:
        while self.peek() in (" ", "\t", "\r", "\n", "#") and self.peek():
            if self.take() == "#":
                while self.peek() not in ("", "\n", "\r"):
                    self.take()

    def escape(self, allowed: set[str]) -> int:
        """The code point of the escape at `\\` (taken)."""
        self.take()
        ch = self.peek()
        if ch in _HEX_ESCAPES:
            digits = self.text[self.pos + 1 : self.pos + 1 + _HEX_ESCAPES[ch]]
            if len(digits) != _HEX_ESCAPES[ch] or not all(c in "0123456789abcdefABCDEF" for c in digits):
                raise self.fail(f"\\{ch} takes exactly {_HEX_ESCAPES[ch]} hex digits")
            self.take(1 + len(digits))
            point = int(digits, 16)
            if point > 0x10FFFF or 0xD800 <= point <= 0xDFFF:
                raise self.fail(f"\\{ch}{digits} is not a character the grammar can hold")
            return point
        if ch not in allowed:
            raise self.fail(f"escape \\{ch} is not supported" if ch else "a grammar cannot end in \\")
        self.take()
        return ord(_C_ESCAPES.get(ch, ch))

    def string(self) -> Token:
        line, column = self.line, self.column
        self.take()
        while self.peek() not in ('"', "\n", "\r", ""):
            if self.peek() == "\\":
                self.escape(_STRING_ESCAPES)
            else:
                self.take()
        if self.peek() != '"':
            raise self.fail('a string literal must end with " on its line')
        self.take()
        return Token("string", "", line, column)

    def char_class(self) -> Token:
        """`[...]` or `[^...]`: characters, escapes and ranges `a-z` with a <= z."""
        line, column = self.line, self.column
        self.take()
        if self.peek() == "^":
            self.take()
        points: list[int | None] = []  # None: a dash
        while self.peek() not in ("]", ""):
            ch = self.peek()
            if ch in ("\n", "\r"):
                raise self.fail("a character class must not hold a newline")
            if ch == "-":
                self.take()
                points.append(None)
            elif ch == "\\":
                if self.peek(1) in ("d", "D", "s", "S", "w", "W"):
                    raise self.fail(f"the class escape \\{self.peek(1)} is not supported; write the range")
                points.append(self.escape(_CLASS_ESCAPES))
            else:
                points.append(ord(self.take()))
        if not self.peek():
            raise self.fail("a character class must end with ]")
        self.take()
        for i in range(1, len(points) - 1):
            lo, hi = points[i - 1], points[i + 1]
            if points[i] is None and lo is not None and hi is not None and lo > hi:
                raise EbnfError(f"line {line}, column {column}: a character range runs backwards")
        return Token("class", "", line, column)


def _tokens(text: str) -> list[Token]:
    lex = _Lexer(text)
    out: list[Token] = []
    while True:
        lex.skip_space()
        line, column, ch = lex.line, lex.column, lex.peek()
        if not ch:
            out.append(Token("end", "", line, column))
            return out
        if ch == '"':
            out.append(lex.string())
        elif ch == "[":
            out.append(lex.char_class())
        elif lex.text.startswith("::=", lex.pos):
            out.append(Token("::=", lex.take(3), line, column))
        elif lex.text.startswith("(=", lex.pos):
            out.append(Token("(=", lex.take(2), line, column))
        elif ch in "()|*+?{},":
            out.append(Token(ch, lex.take(), line, column))
        elif (m := _INT.match(text, lex.pos)) is not None:
            out.append(Token("int", lex.take(len(m.group())), line, column))
        elif (m := _NAME.match(text, lex.pos)) is not None:
            out.append(Token("name", lex.take(len(m.group())), line, column))
        else:
            raise lex.fail(f"unexpected character {ch!r}")


class _Parser:
    def __init__(self, tokens: list[Token]) -> None:
        self.tokens, self.i = tokens, 0
        self.defined: dict[str, Token] = {}
        self.used: list[Token] = []

    def peek(self, delta: int = 0) -> Token:
        return self.tokens[min(self.i + delta, len(self.tokens) - 1)]

    def take(self, kind: str) -> Token:
        tok = self.peek()
        if tok.kind != kind:
            raise self.fail(tok, f"expected {kind}")
        self.i += 1
        return tok

    @staticmethod
    def fail(tok: Token, message: str) -> EbnfError:
        got = "the end" if tok.kind == "end" else repr(tok.text or tok.kind)
        return EbnfError(f"line {tok.line}, column {tok.column}: {message}, got {got}")

    def starts_rule(self) -> bool:
        return self.peek().kind == "name" and self.peek(1).kind == "::="

    def grammar(self) -> None:
        if self.peek().kind == "end":
            raise EbnfError("the grammar is empty")
        while self.peek().kind != "end":
            self.rule()
        if "root" not in self.defined:
            raise EbnfError('the grammar has no rule named "root"')
        for tok in self.used:
            if tok.text not in self.defined:
                raise self.fail(tok, f"rule {tok.text!r} is used but not defined")

    def rule(self) -> None:
        if not self.starts_rule():
            raise self.fail(self.peek(), "expected a rule (name ::= ...)")
        name = self.take("name")
        if self.i >= 2 and self.tokens[self.i - 2].line == name.line:
            raise self.fail(name, "a rule must start its own line")
        if name.text in self.defined:
            raise self.fail(name, f"rule {name.text!r} is defined twice")
        self.defined[name.text] = name
        self.take("::=")
        self.alternatives()
        if self.peek().kind == "(=":
            self.take("(=")
            self.sequence()  # the compiler reads no top-level choice in a lookahead
            self.take(")")

    def alternatives(self) -> None:
        self.sequence()
        while self.peek().kind == "|":
            self.take("|")
            self.sequence()

    def sequence(self) -> None:
        if not self.element():
            raise self.fail(self.peek(), "expected an element (a string, [class], rule name or group)")
        while self.element():
            pass

    def element(self) -> bool:
        """One element and its quantifier, if the next tokens are one (False: the sequence ends)."""
        tok = self.peek()
        if tok.kind in ("string", "class"):
            self.i += 1
        elif tok.kind == "name" and not self.starts_rule():
            after = self.peek(1)
            if after.kind == "(" and (after.line, after.column) == (tok.line, tok.column + len(tok.text)):
                raise self.fail(
                    tok,
                    "macros such as TagDispatch(...) are not supported (a rule name "
                    "and the group after it need a space between them)",
                )
            self.used.append(tok)
            self.i += 1
        elif tok.kind == "(":
            self.i += 1
            self.alternatives()
            self.take(")")
        else:
            return False
        self.quantifier()
        return True

    def quantifier(self) -> None:
        kind = self.peek().kind
        if kind in ("*", "+", "?"):
            self.i += 1
        elif kind == "{":
            self.i += 1
            low = self.bound()
            high: int | None = low
            if self.peek().kind == ",":
                self.i += 1
                high = self.bound() if self.peek().kind == "int" else None
            close = self.take("}")
            if high is not None and low > high:
                raise self.fail(close, f"repetition {{{low},{high}}} has its bounds the wrong way round")
        else:
            return
        if self.peek().kind in ("*", "+", "?", "{"):
            raise self.fail(self.peek(), "one quantifier per element (wrap it in a group)")

    def bound(self) -> int:
        tok = self.take("int")
        if int(tok.text) > MAX_REPEAT:
            raise self.fail(tok, f"repetition bounds above {MAX_REPEAT} are not supported")
        return int(tok.text)

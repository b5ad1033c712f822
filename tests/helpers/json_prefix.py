"""Whether a text is the start of a JSON object: what a grammar-bound generation cut off by
`max_tokens` must be. It is, when some short ending makes it parse as an object."""

from __future__ import annotations

import json

_LITERALS = ("true", "false", "null")


def _closers(text: str) -> str:
    """The brackets still open at the end of `text` (outside strings), closed innermost first."""
    stack: list[str] = []
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            stack.append("}" if ch == "{" else "]")
        elif ch in "}]" and stack:
            stack.pop()
    return "".join(reversed(stack))


def is_object_prefix(text: str) -> bool:
    """True when `text` is a whole JSON object or the start of one."""
    if not text.lstrip().startswith("{"):
        return False
    # A cut string (perhaps mid-escape), number, literal, key or value, then what is open.
    tails = ["", '"', '\\"', "0", "e0", ":0", '":0', '"":0', "null", '":null']
    tails += [lit[k:] for lit in _LITERALS for k in range(1, len(lit))]
    for tail in tails:
        candidate = text + tail
        try:
            if isinstance(json.loads(candidate + _closers(candidate)), dict):
                return True
        except json.JSONDecodeError:
            continue
    return False

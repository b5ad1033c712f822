"""Tool calls streamed: the chat-completion-chunk `delta`s of an answer as its text comes, which
add up to what `tools.parse` gives for the whole text, however the text is split."""

from __future__ import annotations

from typing import Any

from services.gateway.tools import (
    CALL_CLOSE,
    CALL_OPEN,
    Compactor,
    MakeId,
    ToolPlan,
    block_call,
    make_call,
    new_call_id,
    parse,
)


def _opening(index: int, call_id: str, name: str) -> dict[str, Any]:
    return {
        "tool_calls": [{"index": index, "id": call_id, "type": "function", "function": {"name": name, "arguments": ""}}]
    }


def _fragment(index: int, arguments: str) -> dict[str, Any]:
    return {"tool_calls": [{"index": index, "function": {"arguments": arguments}}]}


def _held_prefix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that `tag` starts with (it may be the tag, cut)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ToolStream:
    """The deltas of a streamed answer, as chat-completion-chunk `delta` dicts in order. Their
    concatenation is what `parse` gives for the whole text, however it is split: content as
    soon as it cannot be the start of a `<tool_call>` (its whitespace at either end held, as
    `parse` strips it), a call when its block closes, a named call's arguments as they come."""

    def __init__(self, plan: ToolPlan, make_id: MakeId = new_call_id) -> None:
        self._plan = plan
        self._make_id = make_id
        self._buffer = ""
        """Text not yet decided: a cut `<tool_call>` (auto), a block's text, or all ("required")."""
        self._in_block = False
        self._calls = 0
        self._started = False
        """Whether content went out (leading whitespace is dropped until it does)."""
        self._space = ""
        """Whitespace after the last content sent: sent only if more content follows."""
        self._compact = Compactor()

    @property
    def called(self) -> bool:
        return self._calls > 0

    def feed(self, text: str) -> list[dict[str, Any]]:
        mode = self._plan.mode
        if mode == "none":
            return [{"content": text}] if text else []
        if mode == "named":
            out = self._open_named()
            arguments = self._compact(text)
            return out + ([_fragment(0, arguments)] if arguments else [])
        self._buffer += text
        if mode == "auto" and self._plan.bare_json and not self._started and self._buffer.lstrip()[:1] in ("{", ""):
            return []  # maybe a bare-JSON call: decided at the end (`finish`)
        return self._auto() if mode == "auto" else []

    def finish(self) -> list[dict[str, Any]]:
        mode, text, self._buffer = self._plan.mode, self._buffer, ""
        if mode == "named":
            return self._open_named()
        if mode == "required":
            content, calls = parse(text, self._plan, self._make_id)
            said = [{"content": content}] if content else []
            return said + [delta for c in calls for delta in self._emit(c)]
        if mode == "auto" and self._plan.bare_json and not self._started and not self._in_block:
            content, calls = parse(text, self._plan, self._make_id)
            if calls:
                return [delta for c in calls for delta in self._emit(c)]
            self._buffer = text
            out = self._auto()
            text, self._buffer = self._buffer, ""
            return out + (self._decided(text, closed=False) if self._in_block else self._say(text))
        if mode == "auto" and (text or self._in_block):
            return self._decided(text, closed=False) if self._in_block else self._say(text)
        return []

    def _open_named(self) -> list[dict[str, Any]]:
        if self._calls:
            return []
        self._calls = 1
        return [_opening(0, self._make_id(), self._plan.function or "")]

    def _auto(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        while True:
            if self._in_block:
                end = self._buffer.find(CALL_CLOSE)
                if end < 0:
                    return out
                body, self._buffer = self._buffer[:end], self._buffer[end + len(CALL_CLOSE) :]
                out += self._decided(body, closed=True)
            else:
                start = self._buffer.find(CALL_OPEN)
                if start < 0:
                    cut = len(self._buffer) - _held_prefix(self._buffer, CALL_OPEN)
                    sure, self._buffer = self._buffer[:cut], self._buffer[cut:]
                    return out + self._say(sure)
                out += self._say(self._buffer[:start])
                self._buffer = self._buffer[start + len(CALL_OPEN) :]
                self._in_block = True

    def _decided(self, body: str, closed: bool) -> list[dict[str, Any]]:
        """A block's deltas once its end is known: a call, nothing (a second call where only one
        is allowed), or its text as content."""
        self._in_block = False
        call = block_call(body, self._plan)
        if call is None:
            return self._say(CALL_OPEN + body + (CALL_CLOSE if closed else ""))
        if not self._plan.parallel and self._calls:
            return []
        return self._emit(make_call(self._make_id, *call))

    def _emit(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        index, self._calls = self._calls, self._calls + 1
        function = call["function"]
        return [_opening(index, call["id"], function["name"]), _fragment(index, function["arguments"])]

    def _say(self, text: str) -> list[dict[str, Any]]:
        """Content, its whitespace at the ends held back as `parse`'s strip() would drop it."""
        if not self._started:
            text = text.lstrip()
        body = text.rstrip()
        if not body:
            self._space += text
            return []
        self._started = True
        out, self._space = self._space + body, text[len(body) :]
        return [{"content": out}]

"""OpenAI response bodies and SSE chunks, built from bus events."""

from __future__ import annotations

import json
import time
from typing import Any

from shared.messages import Finished, FinishReason


def finish_reason(event: Finished) -> str:
    return "length" if event.finish_reason == FinishReason.LENGTH else "stop"


def usage(event: Finished) -> dict[str, int]:
    return {
        "prompt_tokens": event.prompt_tokens,
        "completion_tokens": event.completion_tokens,
        "total_tokens": event.prompt_tokens + event.completion_tokens,
    }


def sse(data: dict[str, Any] | str) -> str:
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {payload}\n\n"


class Shape:
    """The two OpenAI shapes that differ only in names: chat and text completions."""

    def __init__(self, chat: bool, request_id: str, model: str) -> None:
        self.chat = chat
        self.id = ("chatcmpl-" if chat else "cmpl-") + request_id
        self.model = model
        self.created = int(time.time())

    def _base(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def full(self, text: str, event: Finished) -> dict[str, Any]:
        if self.chat:
            choice: dict[str, Any] = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": finish_reason(event),
            }
            body = self._base("chat.completion")
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason(event)}
            body = self._base("text_completion")
        return {**body, "choices": [choice], "usage": usage(event)}

    def chunk(self, text: str | None, finish: str | None = None, *, role: bool = False) -> dict[str, Any]:
        if self.chat:
            delta: dict[str, Any] = {}
            if role:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            return {**self._base("chat.completion.chunk"), "choices": [choice]}
        return {
            **self._base("text_completion"),
            "choices": [{"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}],
        }

    def usage_chunk(self, event: Finished) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._base(obj), "choices": [], "usage": usage(event)}

"""OpenAI response bodies and SSE chunks, built from bus events."""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from typing import Any

from shared.messages import Finished, FinishReason, TokenLogprob

OPENAI_TYPE: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    409: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable",
    504: "timeout",
}
"""OpenAI's `error.type` for an HTTP status: clients branch on these."""


def error_body(status: int, message: str, code: str | None, param: str | None = None) -> dict[str, Any]:
    """OpenAI's error body, {"error": {"message", "type", "param", "code"}}: an HTTP error's,
    or the SSE event that ends a stream whose headers are already sent."""
    return {"error": {"message": message, "type": OPENAI_TYPE.get(status, "api_error"), "param": param, "code": code}}


def finish_reason(event: Finished) -> str:
    return "length" if event.finish_reason == FinishReason.LENGTH else "stop"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def sse(data: dict[str, Any] | str) -> str:
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {payload}\n\n"


def _entry(text: str, logprob: float) -> dict[str, Any]:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8", "replace"))}


def chat_logprobs(entries: Sequence[TokenLogprob], texts: Mapping[int, str]) -> dict[str, Any]:
    """Chat's `logprobs`: each token with its alternatives (`texts`: each id's text)."""
    return {
        "content": [
            {**_entry(texts[e.token], e.logprob), "top_logprobs": [_entry(texts[t], lp) for t, lp in e.top]}
            for e in entries
        ],
        "refusal": None,
    }


def completion_logprobs(entries: Sequence[TokenLogprob], texts: Mapping[int, str], offset: int) -> dict[str, Any]:
    """Completions' `logprobs` (the legacy shape); `offset`: where the first token's text starts."""
    offsets = []
    for e in entries:
        offsets.append(offset)
        offset += len(texts[e.token])
    return {
        "tokens": [texts[e.token] for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [{texts[t]: lp for t, lp in e.top} for e in entries],
        "text_offset": offsets,
    }


class Shape:
    """The two OpenAI shapes that differ only in names: chat and text completions."""

    def __init__(self, chat: bool, request_id: str, model: str) -> None:
        self.chat = chat
        self.id = ("chatcmpl-" if chat else "cmpl-") + request_id
        self.model = model
        self.created = int(time.time())

    def _base(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def choice(
        self,
        index: int,
        text: str | None,
        finish: str,
        logprobs: dict[str, Any] | None = None,
        tool_calls: list[dict[str, Any]] | None = None,
    ) -> dict[str, Any]:
        if self.chat:
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if tool_calls:
                message["tool_calls"] = tool_calls
            return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish}
        return {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish}

    def full(self, choices: list[dict[str, Any]], prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
        body = self._base("chat.completion" if self.chat else "text_completion")
        return {**body, "choices": choices, "usage": usage(prompt_tokens, completion_tokens)}

    def chunk(
        self,
        text: str | None,
        finish: str | None = None,
        *,
        role: bool = False,
        index: int = 0,
        logprobs: dict[str, Any] | None = None,
        delta: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """One SSE chunk of choice `index`: its text (chat: or the given `delta`)."""
        if self.chat:
            if delta is None:
                delta = {}
                if role:
                    delta["role"] = "assistant"
                if text is not None:
                    delta["content"] = text
            choice: dict[str, Any] = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
            return {**self._base("chat.completion.chunk"), "choices": [choice]}
        return {
            **self._base("text_completion"),
            "choices": [{"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish}],
        }

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._base(obj), "choices": [], "usage": usage(prompt_tokens, completion_tokens)}

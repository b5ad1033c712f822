"""OpenAI's Responses API (`POST /v1/responses`): text and message input, streamed or not.

A Responses request is translated into a chat completion request and served by the path every
completion takes (`completion.complete`), in a shape of its own (`Answer`), so the two answer
alike: the same rendering of the same messages, the same admission and errors.
Tessera stores nothing: what needs a stored response or conversation, tools, reasoning or
background runs is refused by name (400 `unsupported_parameter`), never silently ignored."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping
from typing import Any, Literal

from fastapi.responses import Response
from pydantic import Field, ValidationError, field_validator, model_validator

from services.gateway.auth import ApiError, Principal, Quotas
from services.gateway.completion import Leg, LegEvent, complete
from services.gateway.openai_format import sse
from services.gateway.protocol import ChatCompletionRequest, Lenient, Text, UnsupportedParameter, asks_nothing
from services.gateway.serving import Gateway
from shared.errors import TesseraError
from shared.messages import Finished, FinishReason


def _unserved(param: str, why: str) -> UnsupportedParameter:
    return UnsupportedParameter(param, f"`{param}` is not supported by Tessera: {why}")


_NO_STORE = "it stores no responses or conversations: send the whole conversation in `input`"
_NO_TOOLS = "it does not call tools yet"


# Responses parameters Tessera cannot serve: name -> (the values that ask for nothing, why).
_UNSERVED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "previous_response_id": (asks_nothing, _NO_STORE),
    "conversation": (asks_nothing, _NO_STORE),
    "tools": (asks_nothing, _NO_TOOLS),
    "tool_choice": (lambda v: asks_nothing(v) or v in ("auto", "none"), _NO_TOOLS),
    "reasoning": (
        lambda v: asks_nothing(v) or (isinstance(v, dict) and all(x in (None, "none") for x in v.values())),
        "the models it serves take no reasoning settings",
    ),
    "background": (asks_nothing, "it answers in the foreground only (stream the answer instead)"),
    "include": (asks_nothing, "it returns no extra output data (logprobs, sources, encrypted reasoning)"),
    "prompt": (asks_nothing, "it keeps no prompt templates"),
    "truncation": (
        lambda v: asks_nothing(v) or v == "disabled",
        "it drops no input to fit the context (a prompt over it is refused)",
    ),
    "top_logprobs": (lambda v: asks_nothing(v) or v == 0, "logprobs are not returned yet"),
    # Chat's, which would reach the chat request: a response has one output message.
    "n": (lambda v: asks_nothing(v) or v == 1, "a response has one output message"),
    "best_of": (lambda v: asks_nothing(v) or v == 1, "a response has one output message"),
}

_ROLES = ("user", "assistant", "system", "developer")
_TEXT_PARTS = ("input_text", "output_text", "text")


def _utf8(text: str, where: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"{where} must be valid Unicode text (a lone surrogate is not)") from None


def _check_input(value: Any) -> None:
    """Each input item checked where it is, so that a 400 says which one is wrong and why (a
    plain union validation would report the string alternative's complaint first)."""
    if isinstance(value, str):
        _utf8(value, "input")
        return
    if not isinstance(value, list):
        raise ValueError("input must be a string or a list of messages")
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise ValueError(f"{where} must be a message: an object with a `role` and `content`")
        kind = item.get("type", "message")
        if kind != "message":
            raise UnsupportedParameter(
                where,
                f"{where}: input items of type {kind!r} are not supported by Tessera "
                "(it takes messages with text content)",
            )
        if item.get("role") not in _ROLES:
            raise ValueError(f"{where}.role must be one of {', '.join(_ROLES)}")
        content = item.get("content")
        if isinstance(content, str):
            _utf8(content, f"{where}.content")
            continue
        if not isinstance(content, list):
            raise ValueError(f"{where}.content must be a string or a list of content parts")
        for j, part in enumerate(content):
            at = f"{where}.content[{j}]"
            kind = part.get("type") if isinstance(part, dict) else None
            if not isinstance(kind, str):
                raise ValueError(f"{at} must be a content part: an object with a `type`")
            if kind not in _TEXT_PARTS:
                raise UnsupportedParameter(
                    at,
                    f"{at}: content of type {kind!r} is not supported by Tessera "
                    f"(it takes text: {', '.join(_TEXT_PARTS)})",
                )
            if not isinstance(part.get("text"), str):
                raise ValueError(f"{at}.text must be a string")
            _utf8(part["text"], f"{at}.text")


class InputText(Lenient):
    type: Literal["input_text", "output_text", "text"]
    text: Text


class InputMessage(Lenient):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Text | list[InputText]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class TextFormat(Lenient):
    type: str
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None

    @model_validator(mode="after")
    def _known(self) -> TextFormat:
        if self.type not in ("text", "json_object", "json_schema"):
            raise _unserved(
                "text.format", f"a format of type {self.type!r} is not served (text, json_object and json_schema are)"
            )
        if self.type == "json_schema" and (not self.name or self.schema_ is None):
            raise ValueError("a json_schema format needs a `name` and a `schema`")
        return self

    def response_format(self) -> dict[str, Any] | None:
        """The chat request's `response_format` asking for the same."""
        if self.type == "json_schema":
            spec = {"name": self.name, "description": self.description, "schema": self.schema_, "strict": self.strict}
            return {"type": "json_schema", "json_schema": {k: v for k, v in spec.items() if v is not None}}
        return {"type": "json_object"} if self.type == "json_object" else None


class TextConfig(Lenient):
    format: TextFormat | None = None
    verbosity: str | None = None

    @field_validator("verbosity")
    @classmethod
    def _medium(cls, v: str | None) -> str | None:
        if v not in (None, "medium"):
            raise _unserved("text.verbosity", "the output's length follows the model and max_output_tokens")
        return v


class ResponsesRequest(Lenient):
    """The parameters used; the unserved are refused by name (`_UNSERVED`), other unknown names
    go on to the chat request (vLLM's sampling extensions: `ignore_eos`, `seed`, `top_k`...),
    which refuses what it does not serve or know."""

    model: str = Field(min_length=1)
    input: Text | list[InputMessage]
    instructions: Text | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    user: str | None = None
    metadata: dict[str, Text] | None = None
    store: bool | None = None
    """Accepted (OpenAI's default is true), but nothing is stored."""
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None

    @field_validator("input", mode="before")
    @classmethod
    def _input(cls, v: Any) -> Any:
        _check_input(v)
        return v

    @model_validator(mode="after")
    def _nothing_silently_ignored(self) -> ResponsesRequest:
        for name, value in (self.model_extra or {}).items():
            if name in _UNSERVED and not _UNSERVED[name][0](value):
                raise _unserved(name, _UNSERVED[name][1])
        return self

    def messages(self) -> list[dict[str, str]]:
        said = (
            [{"role": "user", "content": self.input}]
            if isinstance(self.input, str)
            else [{"role": m.role, "content": m.text()} for m in self.input]
        )
        return ([{"role": "system", "content": self.instructions}] if self.instructions else []) + said

    def format(self) -> dict[str, Any]:
        f = self.text.format if self.text is not None else None
        return {"type": "text"} if f is None else f.model_dump(by_alias=True, exclude_none=True)

    def chat(self) -> ChatCompletionRequest:
        """The chat completion request this one is served as (400 naming the Responses parameter
        when it cannot be)."""
        messages = self.messages()
        if not messages:
            raise ApiError(
                400, "input is empty: give a string or at least one message", "invalid_request", param="input"
            )
        passed = {k: v for k, v in (self.model_extra or {}).items() if k not in _UNSERVED}
        body: dict[str, Any] = {**passed, "model": self.model, "messages": messages, "stream": self.stream}
        for name in ("temperature", "top_p", "user"):
            if getattr(self, name) is not None:
                body[name] = getattr(self, name)
        if self.max_output_tokens is not None:
            body["max_completion_tokens"] = self.max_output_tokens
        f = self.text.format if self.text is not None else None
        if f is not None and f.response_format() is not None:
            body["response_format"] = f.response_format()
        try:
            return ChatCompletionRequest.model_validate(body)
        except ValidationError as e:
            raise _as_responses_error(e) from None


_RENAMED = {"messages": "input", "max_completion_tokens": "max_output_tokens", "response_format": "text.format"}


def _as_responses_error(e: ValidationError) -> ApiError:
    """A chat request's validation error, named by what the client sent to /v1/responses."""
    first: Mapping[str, Any] = e.errors()[0] if e.errors() else {}
    cause = (first.get("ctx") or {}).get("error")
    if isinstance(cause, UnsupportedParameter):
        named = _RENAMED.get(cause.param, cause.param)
        return ApiError(400, str(cause).replace(f"`{cause.param}`", f"`{named}`"), "unsupported_parameter", param=named)
    loc = [str(p) for p in first.get("loc", ())]
    param = ".".join([_RENAMED.get(loc[0], loc[0]), *loc[1:]]) if loc else None
    msg = first.get("msg", "invalid request")
    return ApiError(400, f"{param}: {msg}" if param else msg, "invalid_request", param=param)


class Answer:
    """A response (`completion.ResponseShape`): its fixed parts (ids, the request's settings
    echoed) and its body at each stage, as OpenAI shapes it. One leg: a Responses request has
    one output message."""

    terminator = ""
    """The Responses API ends a stream with its last event, no `[DONE]`."""

    def __init__(self, req: ResponsesRequest, legs: list[Leg]) -> None:
        [leg] = legs
        assert leg.gen is not None
        prepared = leg.prepared
        self.req = req
        self.id = "resp_" + leg.gen.request_id
        self.item_id = "msg_" + uuid.uuid4().hex
        self.created_at = int(time.time())
        self.model = prepared.name
        # The values used, the model's defaults included (OpenAI echoes its own defaults).
        self.temperature = prepared.params.temperature
        self.top_p = prepared.params.top_p

    @staticmethod
    def part(text: str) -> dict[str, Any]:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def item(self, text: str | None, status: str) -> dict[str, Any]:
        """The answer's message; `text` None: not started (no content part yet)."""
        return {
            "id": self.item_id,
            "type": "message",
            "status": status,
            "role": "assistant",
            "content": [] if text is None else [self.part(text)],
        }

    def body(
        self, status: str, text: str | None = None, finished: Finished | None = None, error: TesseraError | None = None
    ) -> dict[str, Any]:
        cut = finished is not None and finished.finish_reason == FinishReason.LENGTH
        output = [] if text is None else [self.item(text, "incomplete" if cut or error else "completed")]
        usage = (
            None
            if finished is None
            else {
                "input_tokens": finished.prompt_tokens,
                "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                "output_tokens": finished.completion_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": finished.prompt_tokens + finished.completion_tokens,
            }
        )
        req = self.req
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "completed_at": int(time.time()) if status == "completed" else None,
            "status": status,
            "background": False,
            "error": None
            if error is None
            else {
                "code": "rate_limit_exceeded" if error.status == 429 else "server_error",
                "message": error.message,
            },
            "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "metadata": req.metadata or {},
            "model": self.model,
            "output": output,
            "parallel_tool_calls": True if req.parallel_tool_calls is None else req.parallel_tool_calls,
            "previous_response_id": None,
            "reasoning": {"effort": None, "summary": None},
            "service_tier": "default",
            "store": False,  # whatever was asked: nothing is kept
            "temperature": self.temperature,
            "text": {"format": req.format(), "verbosity": "medium"},
            "tool_choice": "none" if (req.model_extra or {}).get("tool_choice") == "none" else "auto",
            "tools": [],
            "top_p": self.top_p,
            "truncation": "disabled",
            "usage": usage,
            "user": req.user,
        }

    def final(self, text: str, finished: Finished) -> dict[str, Any]:
        status = "incomplete" if finished.finish_reason == FinishReason.LENGTH else "completed"
        return self.body(status, text, finished)

    async def answer(self, legs: list[Leg]) -> dict[str, Any]:
        [leg] = legs
        assert leg.finished is not None
        return self.final("".join(leg.text), leg.finished)

    async def stream(self, legs: list[Leg], events: AsyncIterator[LegEvent]) -> AsyncGenerator[str, None]:
        """OpenAI's streamed events, each `event: <type>` and `data: <json>` with a sequence
        number; a failure part-way ends with `error` and `response.failed`."""
        seq = 0

        def emit(kind: str, **fields: Any) -> str:
            nonlocal seq
            data = {"type": kind, "sequence_number": seq, **fields}
            seq += 1
            return f"event: {kind}\n" + sse(data)

        at = {"item_id": self.item_id, "output_index": 0, "content_index": 0}
        parts: list[str] = []
        try:
            yield emit("response.created", response=self.body("in_progress"))
            yield emit("response.in_progress", response=self.body("in_progress"))
            yield emit("response.output_item.added", output_index=0, item=self.item(None, "in_progress"))
            yield emit("response.content_part.added", **at, part=self.part(""))
            async for _, event in events:
                if isinstance(event, Finished):
                    text = "".join(parts)
                    body = self.final(text, event)
                    yield emit("response.output_text.done", **at, text=text, logprobs=[])
                    yield emit("response.content_part.done", **at, part=self.part(text))
                    yield emit("response.output_item.done", output_index=0, item=body["output"][0])
                    yield emit(f"response.{body['status']}", response=body)
                elif event.text:
                    parts.append(event.text)
                    yield emit("response.output_text.delta", **at, delta=event.text, logprobs=[])
        except TesseraError as e:
            # Headers are gone already: the error travels as events, the last one terminal.
            yield emit("error", code=e.code.value, message=e.message, param=e.param)
            yield emit("response.failed", response=self.body("failed", "".join(parts), error=e))


async def respond(
    gateway: Gateway, quotas: Quotas, who: Principal, req: ResponsesRequest, max_wait: str | None = None
) -> Response:
    """Served as its chat request is (`completion.complete`), in the Responses shape; an error
    before the answer starts names what the client sent (`input`, not `messages`)."""
    chat = req.chat()
    try:
        return await complete(gateway, quotas, who, chat, lambda legs: Answer(req, legs), max_wait, stream_error)
    except (TesseraError, ApiError) as e:
        if e.param is not None:
            e.param = _RENAMED.get(e.param, e.param)
        raise


def stream_error(status: int, message: str, code: str | None, param: str | None) -> str:
    """The Responses stream's `error` event, for a start that failed after the stream showing
    its progress began (before `response.created`: no response was made)."""
    return "event: error\n" + sse(
        {"type": "error", "sequence_number": 0, "code": code, "message": message, "param": param}
    )

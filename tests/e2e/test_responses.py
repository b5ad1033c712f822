"""OpenAI's Responses API (`POST /v1/responses`) through the official `openai` client, against
the real cluster and model; and its streamed events when the engine fails part-way."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import jsonschema_rs
import openai
import pytest

from services.gateway.completion import Leg
from services.gateway.completion import stream as stream_answer
from services.gateway.responses import Answer, ResponsesRequest
from shared.errors import TesseraError
from shared.messages import ErrorCode, Finished, TokenChunk

ASK = "Name three colours."
INSTRUCTIONS = "You are a helpful assistant. Answer briefly."


def test_text_input_answers_with_output_text_and_usage(client: openai.OpenAI, model: str) -> None:
    r = client.responses.create(model=model, input=ASK, max_output_tokens=12, temperature=0)
    assert r.object == "response" and r.id.startswith("resp_")
    assert r.status in ("completed", "incomplete")
    assert r.output_text
    [item] = r.output
    assert item.type == "message" and item.role == "assistant" and item.id.startswith("msg_")
    assert [c.type for c in item.content] == ["output_text"]
    assert r.usage is not None and 1 <= r.usage.output_tokens <= 12
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    # The chat template wraps the message: the prompt is longer than its bare words.
    assert r.usage.input_tokens > 10
    assert r.error is None and r.tools == [] and r.max_output_tokens == 12


def test_messages_and_instructions_are_served_and_echoed(client: openai.OpenAI, model: str) -> None:
    r = client.responses.create(
        model=model,
        instructions=INSTRUCTIONS,
        input=[
            {"role": "user", "content": "What is 2 + 2?"},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "4."}]},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": ASK}]},
        ],
        max_output_tokens=12,
        temperature=0,
        metadata={"ticket": "42"},
        store=True,
    )
    assert r.output_text
    assert r.instructions == INSTRUCTIONS and r.metadata == {"ticket": "42"}
    assert r.text is not None and r.text.format is not None and r.text.format.type == "text"


def test_greedy_output_is_the_chat_completion_of_the_same_messages(client: openai.OpenAI, model: str) -> None:
    chat = client.chat.completions.create(
        model=model,
        max_tokens=10,
        temperature=0,
        messages=[{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": ASK}],
    )
    r = client.responses.create(model=model, instructions=INSTRUCTIONS, input=ASK, max_output_tokens=10, temperature=0)
    assert r.output_text == chat.choices[0].message.content
    assert chat.usage is not None and r.usage is not None
    assert (r.usage.input_tokens, r.usage.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)


def test_streamed_events_build_the_same_answer(client: openai.OpenAI, model: str) -> None:
    # The first of identical greedy requests may read a different text than its repeats: with
    # prefix caching, it computes the blocks the repeats read from the cache, and the core's
    # bf16 arithmetic differs in the last bits between the two (measured: the first request
    # after a start differs, every repeat agrees; on an AMD EPYC with AVX-512 bf16, a request of
    # one token cached too little: the next 10-token one still differed). So the same request
    # is made once first.
    client.responses.create(model=model, input=ASK, max_output_tokens=10, temperature=0)
    plain = client.responses.create(model=model, input=ASK, max_output_tokens=10, temperature=0)
    events = list(client.responses.create(model=model, input=ASK, max_output_tokens=10, temperature=0, stream=True))
    types = [e.type for e in events]
    assert types[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert types[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        f"response.{plain.status}",
    ]
    assert set(types[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response  # type: ignore[union-attr]
    assert deltas == final.output_text == events[-4].text == plain.output_text  # type: ignore[union-attr]
    assert final.id == events[0].response.id  # type: ignore[union-attr]
    assert final.usage is not None and plain.usage is not None
    assert final.usage.output_tokens == plain.usage.output_tokens


def test_the_sdks_stream_helper_reads_the_events(client: openai.OpenAI, model: str) -> None:
    # A stop sequence (vLLM's, passed on) ends it as "completed", which the helper waits for.
    with client.responses.stream(
        model=model, input=ASK, max_output_tokens=40, temperature=0, extra_body={"stop": ["\n", "."]}
    ) as stream:
        deltas = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert deltas and final.output_text == deltas and final.status == "completed"


def test_max_output_tokens_ends_incomplete(client: openai.OpenAI, model: str) -> None:
    kw: dict[str, Any] = {
        "model": model,
        "input": ASK,
        "max_output_tokens": 3,
        "temperature": 0,
        "extra_body": {"ignore_eos": True},
    }
    r = client.responses.create(**kw)
    assert r.status == "incomplete"
    assert r.incomplete_details is not None and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage is not None and r.usage.output_tokens == 3
    assert r.output[0].status == "incomplete"  # type: ignore[union-attr]
    last = list(client.responses.create(**kw, stream=True))[-1]
    assert last.type == "response.incomplete"
    assert last.response.status == "incomplete" and last.response.output_text == r.output_text


PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


def test_a_json_schema_text_format_gives_json_that_validates(client: openai.OpenAI, model: str) -> None:
    """Served by the chat request's `response_format`: waits for it where that is refused."""
    r = client.responses.create(
        model=model,
        input="Make up a person: a name and an age.",
        max_output_tokens=60,
        temperature=0,
        text={"format": {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}},
    )
    assert r.status == "completed"
    jsonschema_rs.validate(PERSON, json.loads(r.output_text))
    assert r.text is not None and r.text.format is not None and r.text.format.type == "json_schema"


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"previous_response_id": "resp_x"}, "previous_response_id"),
        ({"conversation": "conv_x"}, "conversation"),
        ({"tools": [{"type": "function", "name": "f", "parameters": {}}]}, "tools"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"reasoning": {"effort": "high"}}, "reasoning"),
        ({"background": True}, "background"),
        ({"include": ["message.output_text.logprobs"]}, "include"),
        ({"prompt": {"id": "pmpt_x"}}, "prompt"),
        (
            {
                "input": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "input_text", "text": "Hi"},
                            {"type": "input_image", "image_url": "https://x/y.png"},
                        ],
                    }
                ]
            },
            "input[0].content[1]",
        ),
        ({"input": [{"type": "function_call_output", "call_id": "c", "output": "{}"}]}, "input[0]"),
    ],
)
def test_what_tessera_cannot_serve_is_refused_by_name(
    client: openai.OpenAI, model: str, extra: dict[str, Any], param: str
) -> None:
    kw: dict[str, Any] = {"model": model, "input": "Hi", "max_output_tokens": 2, **extra}
    for stream in (False, True):  # refused before a stream starts, as a 400
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.create(**kw, stream=stream)
        body: Any = e.value.body
        assert body["code"] == "unsupported_parameter" and body["param"] == param
        assert body["type"] == "invalid_request_error" and "not supported" in body["message"]


def test_off_values_are_accepted(client: openai.OpenAI, model: str) -> None:
    r = client.responses.create(
        model=model,
        input="Hi",
        max_output_tokens=2,
        tools=[],
        tool_choice="auto",
        include=[],
        background=False,
        store=False,
        truncation="disabled",
        parallel_tool_calls=True,
        text={"format": {"type": "text"}},
    )
    assert r.status in ("completed", "incomplete")


def test_an_unknown_model_is_404_and_an_overlong_input_names_input(client: openai.OpenAI, model: str) -> None:
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="no-such-model", input="Hi")
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=model, input="hello " * 9000)
    body: Any = e.value.body
    assert body["code"] == "context_length_exceeded" and body["param"] == "input"


# --- a failure part-way, without a cluster ------------------------------------------------------


class _FailingGeneration:
    """A generation whose engine dies after its first chunk."""

    def __init__(self) -> None:
        self.closed = False

    async def events(self) -> AsyncIterator[TokenChunk | Finished]:
        yield TokenChunk(request_id="r", text="Red", tokens=1)
        raise TesseraError(ErrorCode.ENGINE_FAILED, "the engine stopped responding", retry_after_s=1)

    async def close(self) -> None:
        self.closed = True


class _Quotas:
    def __init__(self) -> None:
        self.settled: list[int] = []

    async def settle(self, grant: object, completion_tokens: int) -> None:
        self.settled.append(completion_tokens)


def _leg(gen: _FailingGeneration) -> Leg:
    prepared = SimpleNamespace(
        name="m", record=SimpleNamespace(name="m"), params=SimpleNamespace(temperature=0.0, top_p=1.0)
    )
    gen.request_id = "abc"  # type: ignore[attr-defined]
    return Leg(0, 0, prepared, "", gen=gen, grant=object())  # type: ignore[arg-type]


def _parse(raw: str) -> tuple[str, dict[str, Any]]:
    event, data = raw.rstrip("\n").split("\n")
    assert event.startswith("event: ") and data.startswith("data: ")
    return event.removeprefix("event: "), json.loads(data.removeprefix("data: "))


async def test_a_failure_part_way_ends_with_error_then_response_failed() -> None:
    gen, quotas = _FailingGeneration(), _Quotas()
    legs = [_leg(gen)]
    answer = Answer(ResponsesRequest(model="m", input="Hi"), legs)
    raw = [chunk async for chunk in stream_answer(answer, legs, quotas)]  # type: ignore[arg-type]
    events = [_parse(r) for r in raw]
    assert [name for name, _ in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "error",
        "response.failed",
    ]
    assert all(name == data["type"] for name, data in events)
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    error = events[-2][1]
    assert error["code"] == "engine_failed" and "stopped responding" in error["message"]
    failed = events[-1][1]["response"]
    assert failed["status"] == "failed" and failed["id"] == "resp_abc"
    assert failed["error"]["code"] == "server_error"
    assert failed["output"][0]["status"] == "incomplete"
    assert failed["output"][0]["content"][0]["text"] == "Red"
    assert gen.closed and quotas.settled == [1]  # the engine is told to stop; the quota keeps 1 token
    assert not any("[DONE]" in r for r in raw)

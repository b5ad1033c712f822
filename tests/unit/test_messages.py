import msgspec
import pytest

from services.gateway.openai_format import error_body
from shared import subjects
from shared.bus import decode, encode
from shared.errors import TesseraError
from shared.messages import (
    SCHEMA_VERSION,
    ErrorCode,
    Failed,
    Finished,
    FinishReason,
    Generate,
    InstanceReady,
    Rejected,
    SamplingParams,
    StreamEvent,
    TokenChunk,
)


def test_a_message_survives_the_wire_unchanged() -> None:
    g = Generate(
        request_id="r1",
        model="m",
        prompt="hi",
        prompt_ids=(1, 2),
        prompt_tokens=2,
        params=SamplingParams(max_tokens=5, stop=("x",), seed=3),
        stream_subject="s",
    )
    assert decode(encode(g), Generate) == g


def test_a_union_decodes_to_the_type_that_was_sent() -> None:
    for event in (
        TokenChunk(request_id="r", text="a", tokens=1),
        Finished(request_id="r", finish_reason=FinishReason.STOP, prompt_tokens=1, completion_tokens=1),
        Failed(request_id="r", code=ErrorCode.ENGINE_FAILED, message="x"),
    ):
        assert decode(encode(event), StreamEvent) == event


def test_a_reply_of_the_wrong_type_is_refused() -> None:
    data = encode(Rejected(code=ErrorCode.NO_CAPACITY, message="full"))
    with pytest.raises(msgspec.ValidationError):
        decode(data, InstanceReady)


def test_every_subject_carries_the_schema_version() -> None:
    built = [subjects.place(), subjects.engine_generate("n"), subjects.token_stream("r"), subjects.node_heartbeat()]
    assert all(s.startswith(f"tessera.v{SCHEMA_VERSION}.") for s in built)


def test_errors_map_to_openai_bodies_and_statuses() -> None:
    e = TesseraError(ErrorCode.OVERLOADED, "busy", retry_after_s=1)
    assert e.status == 429
    assert error_body(e.status, e.message, e.code.value)["error"]["type"] == "rate_limit_error"
    assert TesseraError(ErrorCode.MODEL_NOT_FOUND, "x").status == 404
    assert TesseraError(ErrorCode.CONTEXT_LENGTH_EXCEEDED, "x").status == 400

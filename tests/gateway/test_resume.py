"""A preempted request resumes on another node (services/gateway/generation.py), and one preempted
more often than MAX_RESUMES ends with a 503 `preempted` error. The bus here is a fake (named
so): the scheduler and an engine that preempts every request it gets are scripted, since no
real cluster preempts one request three times on demand. The real path is in
tests/e2e/test_preemption.py and tests/e2e/test_kv_eviction.py; the cap and the text carried
across two resumes on a real cluster (preempted by real `PreemptInstance` orders) in
tests/e2e/test_real_faults.py."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import pytest

from services.gateway.generation import MAX_RESUMES, Generation, Prepared
from services.gateway.serving import Gateway
from services.gateway.settings import GatewaySettings
from shared import subjects
from shared.bus import encode
from shared.errors import HTTP_STATUS, TesseraError
from shared.messages import (
    Artifact,
    ErrorCode,
    Failed,
    Finished,
    FinishReason,
    Generate,
    GenerateAccepted,
    ModelRecord,
    SamplingParams,
    TokenChunk,
)
from shared.routing_messages import Placement, PlaceRequest


@dataclass
class _Msg:
    data: bytes


@dataclass
class _Sub:
    queue: asyncio.Queue[_Msg] = field(default_factory=asyncio.Queue)

    async def next_msg(self, timeout: float) -> _Msg:
        return await asyncio.wait_for(self.queue.get(), timeout)

    async def unsubscribe(self) -> None:
        pass


class FakeBus:
    """The scheduler places on node-1, node-2, …; each engine streams one token of text and
    then preempts the request, until `preemptions` have happened; then it finishes."""

    def __init__(self, preemptions: int, code: ErrorCode = ErrorCode.PREEMPTED, text: bool = True) -> None:
        self.preemptions = preemptions
        self.code = code
        self.text = text
        self.places: list[PlaceRequest] = []
        self.generates: list[Generate] = []
        self.subs: dict[str, _Sub] = {}

    async def request(self, subject: str, msg: Any, type_: Any, timeout: float) -> Any:
        if subject == subjects.place():
            self.places.append(msg)
            return Placement(request_id=msg.request_id, node_id=f"node-{len(self.places)}", cold_start=False)
        assert isinstance(msg, Generate)
        self.generates.append(msg)
        sub = self.subs[msg.stream_subject]
        refused = len(self.generates) <= self.preemptions
        if self.text or not refused:
            sub.queue.put_nowait(
                _Msg(encode(TokenChunk(request_id=msg.request_id, text=f" w{len(self.generates)}", tokens=1)))
            )
        if refused:
            end: Any = Failed(request_id=msg.request_id, code=self.code, message="no")
        else:
            end = Finished(
                request_id=msg.request_id,
                finish_reason=FinishReason.LENGTH,
                prompt_tokens=len(msg.prompt_ids),
                completion_tokens=1,
            )
        sub.queue.put_nowait(_Msg(encode(end)))
        return GenerateAccepted(request_id=msg.request_id)

    async def subscribe(self, subject: str) -> _Sub:
        self.subs[subject] = _Sub()
        return self.subs[subject]

    async def publish(self, subject: str, msg: Any) -> None:
        pass


class FakeTokenizers:
    async def get(self, artifact: Artifact) -> None:
        return None

    async def encode(self, tokenizer: None, text: str) -> tuple[int, ...]:
        return tuple(range(len(text.split())))


def generation(bus: FakeBus) -> Generation:
    gw = Gateway(GatewaySettings(), bus, None)  # type: ignore[arg-type]
    gw.tokenizers = FakeTokenizers()  # type: ignore[assignment]
    artifact = Artifact(
        artifact_id="a", path="/a", source_sha256="s", context_length=100, kv_bytes_per_token=1, weight_bytes=1
    )
    record = ModelRecord(
        name="m", source="/m.gguf", artifact=artifact, ttft_slo_s=1.0, tpot_slo_s=0.1, keep_alive_s=60, created_at=0
    )
    return Generation(gw, Prepared(record, "the prompt", (1, 2), SamplingParams(max_tokens=10)))


async def drain(g: Generation) -> list[TokenChunk | Finished]:
    await g.open()
    try:
        return [e async for e in g.events()]
    finally:
        await g.close()


async def test_a_preempted_request_goes_on_elsewhere_from_its_text_so_far() -> None:
    bus = FakeBus(preemptions=MAX_RESUMES)
    events = await drain(generation(bus))
    assert "".join(e.text for e in events if isinstance(e, TokenChunk)) == " w1 w2 w3"
    done = events[-1]
    assert isinstance(done, Finished) and done.completion_tokens == MAX_RESUMES + 1
    # Each resume avoids the node that preempted it, prefills the text so far, and asks for
    # what is left of the client's max_tokens.
    assert [p.avoid for p in bus.places] == ["", "node-1", "node-2"]
    assert [g.prompt for g in bus.generates] == ["the prompt", "the prompt w1", "the prompt w1 w2"]
    assert [g.params.max_tokens for g in bus.generates] == [10, 9, 8]


async def test_a_request_preempted_more_than_max_resumes_times_fails_with_503() -> None:
    bus = FakeBus(preemptions=MAX_RESUMES + 1)
    with pytest.raises(TesseraError) as e:
        await drain(generation(bus))
    assert e.value.code == ErrorCode.PREEMPTED and HTTP_STATUS[ErrorCode.PREEMPTED] == 503
    assert e.value.retry_after_s
    assert len(bus.generates) == MAX_RESUMES + 1


async def test_a_request_refused_for_memory_before_its_first_token_is_placed_elsewhere() -> None:
    # The node had no memory for its KV cache (NO_CAPACITY after waiting): another node, the
    # same request.
    bus = FakeBus(preemptions=1, code=ErrorCode.NO_CAPACITY, text=False)
    events = await drain(generation(bus))
    assert "".join(e.text for e in events if isinstance(e, TokenChunk)) == " w2"
    assert [p.avoid for p in bus.places] == ["", "node-1"]
    assert [g.prompt for g in bus.generates] == ["the prompt", "the prompt"]
    assert [g.params.max_tokens for g in bus.generates] == [10, 10]
    # Refused everywhere: the client gets the 503 (no_capacity, Retry-After) once out of nodes.
    bus = FakeBus(preemptions=MAX_RESUMES + 1, code=ErrorCode.NO_CAPACITY, text=False)
    with pytest.raises(TesseraError) as e:
        await drain(generation(bus))
    assert e.value.code == ErrorCode.NO_CAPACITY and HTTP_STATUS[ErrorCode.NO_CAPACITY] == 503


async def test_a_request_refused_for_memory_after_streaming_text_is_not_moved() -> None:
    # Only before the first token: later, the engine's errors are the request's own.
    bus = FakeBus(preemptions=1, code=ErrorCode.NO_CAPACITY, text=True)
    with pytest.raises(TesseraError) as e:
        await drain(generation(bus))
    assert e.value.code == ErrorCode.NO_CAPACITY and len(bus.generates) == 1

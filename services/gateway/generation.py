"""One admitted request on its engine (`Generation`): placed (its cold start's progress shown
to a stream), sent, its tokens relayed, resumed on another node where its instance went away
mid-way, and always closed (a client that leaves cancels its decoding). `Prepared` is what it
runs: the request rendered and tokenized against its model (`serving.Gateway.prepare`)."""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec
from nats.aio.subscription import Subscription
from nats.errors import TimeoutError as NatsTimeout
from prometheus_client import Counter, Histogram

from policy.slo import ttft_slo
from services.gateway.loading import Placing
from services.gateway.tools import ToolPlan
from shared import subjects
from shared.adapters import AdapterRecord, adapter_ref
from shared.bus import decode
from shared.errors import TesseraError
from shared.messages import (
    Cancel,
    ErrorCode,
    Failed,
    Finished,
    Generate,
    GenerateAccepted,
    ModelRecord,
    Rejected,
    SamplingParams,
    StreamEvent,
    TokenChunk,
)
from shared.routing_messages import Placement, PlaceRequest

if TYPE_CHECKING:
    from services.gateway.serving import Gateway

log = logging.getLogger(__name__)

PLACE_ATTEMPTS = 4
"""Placements a request may get when its instance is gone by the time it is sent."""
TTFT = Histogram(
    "tessera_gateway_ttft_seconds",
    "Request admitted to first token relayed",
    ["cold"],
    buckets=(0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32),
)
TPOT = Histogram(
    "tessera_gateway_tpot_seconds",
    "Mean seconds per output token after the first, per request",
    buckets=(0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64),
)
RESUMED = Counter(
    "tessera_gateway_resumed_total",
    "Requests that went on on another node: their instance was preempted mid-way, or their node had no memory for them",
)
MAX_RESUMES = 2
"""Moves to another node one request makes (then its error reaches the client)."""
PLACEMENT_WAIT = Histogram(
    "tessera_gateway_placement_seconds",
    "Seconds waiting for a placement (cold starts included)",
    buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 2, 4, 8, 16, 32),
)


@dataclass(frozen=True)
class Prepared:
    record: ModelRecord
    prompt: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    tools: ToolPlan | None = None
    """How a chat request's tools were shown to the model, and how to read its calls back."""
    adapter: AdapterRecord | None = None
    """The LoRA adapter the caller named (issue 34): `record` is then its base (with the
    adapter's SLOs), which is placed and started as for a request for the base."""

    @property
    def name(self) -> str:
        """What the caller asked for: the answer's `model`."""
        return self.adapter.name if self.adapter is not None else self.record.name

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_ids)


class Generation:
    """One admitted request on its engine: iterate `events()`, always `close()`."""

    def __init__(
        self, gateway: Gateway, prepared: Prepared, max_wait_s: float | None = None, placing: Placing | None = None
    ) -> None:
        self.gw = gateway
        self.prepared = prepared
        self.max_wait_s = max_wait_s
        self.placing = placing
        """Its request's models being placed now (a stream shows their starts' progress)."""
        """Its cold-start budget, for its first placement (a resumed stream has begun)."""
        self.placed: Placement | None = None
        """Its first placement (a cold one says what the start cost it)."""
        self.start_waited_s = 0.0
        self.request_id = uuid.uuid4().hex
        self.node_id = ""
        self.cold = False
        self.admitted_at = time.perf_counter()
        self._sub: Subscription | None = None
        self._done = False
        self._admitted = False
        self._prompt_tokens = 0
        """The client's prompt's tokens (set at a resume, whose new prompt holds more)."""
        self._client_prompt: str | None = None
        """The client's prompt (set at a resume, whose new prompt holds the text so far)."""
        self._text = ""
        """Text streamed so far (a resumed request goes on from it)."""
        self._carried = 0
        """Tokens streamed before the last resume."""
        self.resumes = 0

    async def open(self) -> None:
        # Its own TTFT SLO, grown to its prompt (LLM-Mesh §8.1), as the scheduler judges it.
        slo = ttft_slo(self.prepared.record, self.prepared.prompt_tokens)
        await self.gw.admit(slo * self.gw.settings.queue_slo_multiple)
        self._admitted = True
        await self._send()

    def _line_budget_s(self) -> float:
        """How much longer it may wait for room: what is left of the line's deadline (its
        TTFT SLO × `queue_slo_multiple`) since it was admitted."""
        slo = ttft_slo(self.prepared.record, self.prepared.prompt_tokens)
        return max(0.0, slo * self.gw.settings.queue_slo_multiple - (time.perf_counter() - self.admitted_at))

    async def _send(self, avoid: str = "") -> None:
        """Place the request and send it to its engine (placed again if the instance went away
        in between: under memory pressure instances come and go, and a start that waited for
        room may find the one it was placed on gone more than once); `avoid`: a node that just
        preempted it."""
        not_on = ""
        for attempt in range(PLACE_ATTEMPTS):
            t0 = time.perf_counter()
            model = self.prepared.record.name
            if self.placing is not None:
                self.placing.models[model] += 1
            try:
                placement = await self.gw.bus.request(
                    subjects.place(),
                    PlaceRequest(
                        request_id=self.request_id,
                        model=model,
                        prompt_tokens=self.prepared.prompt_tokens,
                        max_tokens=self.prepared.params.max_tokens,
                        not_on=not_on,
                        avoid=avoid,
                        wait_s=self._line_budget_s(),
                        max_wait_s=self.max_wait_s if self.placed is None else None,
                    ),
                    Placement | Rejected,
                    timeout=self.gw.settings.placement_timeout_s,
                )
            finally:
                if self.placing is not None:  # at once, before any progress event is read
                    self.placing.models[model] -= 1
            PLACEMENT_WAIT.observe(time.perf_counter() - t0)
            if isinstance(placement, Rejected):
                raise TesseraError(placement.code, placement.message, retry_after_s=placement.retry_after_s)
            if self.placed is None:
                self.placed, self.start_waited_s = placement, time.perf_counter() - t0
            self.node_id, self.cold = placement.node_id, placement.cold_start
            self.gw.node_seen.setdefault(self.node_id, time.time())
            self._sub = await self.gw.bus.subscribe(subjects.token_stream(self.request_id))
            accepted = await self.gw.bus.request(
                subjects.engine_generate(self.node_id),
                Generate(
                    request_id=self.request_id,
                    model=self.prepared.record.name,
                    prompt=self.prepared.prompt,
                    prompt_ids=self.prepared.prompt_ids,
                    prompt_tokens=self.prepared.prompt_tokens,
                    params=self.prepared.params,
                    stream_subject=subjects.token_stream(self.request_id),
                    adapter=adapter_ref(self.prepared.adapter) if self.prepared.adapter is not None else None,
                ),
                GenerateAccepted | Failed,
                timeout=self.gw.settings.request_timeout_s,
            )
            if isinstance(accepted, GenerateAccepted):
                return
            await self._sub.unsubscribe()
            self._sub = None
            not_on = self.node_id
            # The instance was scaled in between placement and send: place once more.
            if accepted.code != ErrorCode.INSTANCE_NOT_LOADED or attempt == PLACE_ATTEMPTS - 1:
                raise TesseraError(accepted.code, accepted.message, retry_after_s=1)
        raise AssertionError("unreachable")

    async def _resume(self, tokens: int) -> None:
        """Its instance was preempted (LLM-Mesh §7.1) or its node could not hold it: go on on
        another node from where it stopped, its prompt and the text so far prefilled there as
        the new prompt (vLLM's recomputation), for the tokens it has left. The client's
        stream goes on."""
        RESUMED.inc()
        self.resumes += 1
        preempted_on = self.node_id
        if self._sub is not None:
            await self._sub.unsubscribe()
            self._sub = None
        p = self.prepared
        self._prompt_tokens = self._prompt_tokens or p.prompt_tokens
        self._client_prompt = self._client_prompt if self._client_prompt is not None else p.prompt
        prompt = self._client_prompt + self._text  # a second resume's prompt already holds the text
        ids = await self.gw.tokenizers.encode(await self.gw.tokenizers.get(p.record.artifact), prompt)
        left = p.params.max_tokens - (tokens - self._carried)
        self._carried = tokens
        params = msgspec.structs.replace(p.params, max_tokens=max(left, 1))
        self.prepared = dataclasses.replace(p, prompt=prompt, prompt_ids=ids, params=params, tools=None)
        self.request_id = uuid.uuid4().hex
        await self._send(avoid=preempted_on)

    async def events(self) -> AsyncGenerator[TokenChunk | Finished]:
        assert self._sub is not None
        last = time.monotonic()
        first_at: float | None = None
        tokens = 0
        while True:
            try:
                msg = await self._sub.next_msg(timeout=self.gw.settings.liveness_check_s)
            except NatsTimeout:
                if not self.gw.node_alive(self.node_id):
                    raise TesseraError(
                        ErrorCode.ENGINE_FAILED,
                        f"the engine on {self.node_id} stopped responding; the request was lost "
                        "there and can be retried",
                        retry_after_s=1,
                    ) from None
                if time.monotonic() - last > self.gw.settings.stream_idle_timeout_s:
                    raise TesseraError(ErrorCode.TIMEOUT, "the engine produced no token in time") from None
                continue
            last = time.monotonic()
            event = decode(msg.data, StreamEvent)
            if isinstance(event, Failed):
                # Preempted (§7.1, §6.4), or refused before its first token by a node with no
                # memory left for its KV cache: it goes on on another node.
                movable = event.code == ErrorCode.PREEMPTED or (event.code == ErrorCode.NO_CAPACITY and not tokens)
                if movable and self.resumes < MAX_RESUMES:
                    await self._resume(tokens)
                    last = time.monotonic()
                    continue
                self._done = True
                raise TesseraError(event.code, event.message, retry_after_s=1)
            if isinstance(event, TokenChunk):
                if first_at is None and event.text:
                    first_at = time.perf_counter()
                    TTFT.labels(str(self.cold).lower()).observe(first_at - self.admitted_at)
                tokens += event.tokens
                self._text += event.text
                yield event
            else:
                self._done = True
                if self._carried:  # the whole request, not its last leg
                    event = msgspec.structs.replace(
                        event,
                        completion_tokens=event.completion_tokens + self._carried,
                        prompt_tokens=self._prompt_tokens,
                    )
                if tokens < event.completion_tokens:
                    # Chunks published while the bus was reconnecting never reached us: the text
                    # has a hole. Say so rather than pass it off as the completion.
                    raise TesseraError(
                        ErrorCode.UNAVAILABLE,
                        f"{event.completion_tokens - tokens} of the {event.completion_tokens} tokens "
                        "generated were lost on the way from the engine (the bus was interrupted); "
                        "the request can be retried",
                        retry_after_s=1,
                    )
                if first_at is not None and tokens > 1:
                    TPOT.observe((time.perf_counter() - first_at) / (tokens - 1))
                yield event
                return

    async def close(self) -> None:
        if self._sub is not None:
            if not self._done and self.node_id:
                # The client left or something failed: stop the engine decoding for nobody.
                try:
                    await self.gw.bus.publish(subjects.engine_cancel(self.node_id), Cancel(request_id=self.request_id))
                except Exception:
                    log.warning("could not send cancel for %s", self.request_id)
            try:
                await self._sub.unsubscribe()
            except Exception:
                pass
            self._sub = None
        if self._admitted:
            self._admitted = False
            self.gw.release()

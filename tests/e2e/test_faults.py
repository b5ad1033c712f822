"""Faults on a cluster of its own, with traffic in flight: the scheduler killed, NATS restarted,
the engine killed under a burst of streams. Every admitted request ends, with its completion or
an OpenAI-format error the client can read, within a deadline; none is left hanging.

Covered elsewhere, not repeated here: an engine or a worker killed under one stream, NATS lost
while idle (tests/e2e/test_restarts.py, test_resident_pool.py); registrations and API keys
across a restart of Valkey (test_restarts.py, test_auth.py)."""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from nats.errors import TimeoutError as NatsTimeout

from ops.localcluster import LocalCluster
from services.gateway.generation import Generation
from services.gateway.serving import Gateway
from services.gateway.settings import GatewaySettings
from shared.bus import encode
from shared.errors import TesseraError
from shared.messages import Finished, FinishReason, TokenChunk
from tests.conftest import start_cluster
from tests.helpers.cluster import metric, on_the_core, register, wait_for

PROMPT = [{"role": "user", "content": "Tell a long story about a lighthouse."}]


@pytest.fixture(scope="module")
def own_cluster(tmp_path_factory: pytest.TempPathFactory, model_store: Path) -> Iterator[LocalCluster]:
    """This module's own cluster, one request per batch: the NATS test checks each completion
    against a reference run alone, and a batched run's greedy text may differ from it in
    late tokens (kernels round differently at another batch width; batching is tested in
    test_batching.py)."""
    c = start_cluster(tmp_path_factory.mktemp("faults"), model_store, TESSERA_MAX_INFLIGHT="32", TESSERA_MAX_BATCH="1")
    try:
        yield c
    finally:
        c.stop()


def body(model: str, max_tokens: int, stream: bool) -> dict[str, object]:
    return {
        "model": model,
        "messages": PROMPT,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
        "stream_options": {"include_usage": True},
    }


def assert_openai_error(payload: object) -> dict[str, object]:
    assert isinstance(payload, dict) and isinstance(payload.get("error"), dict), payload
    err: dict[str, object] = payload["error"]
    assert err["message"] and err["type"], err
    return err


@dataclass
class Outcome:
    """How one request ended, as a client sees it."""

    status: int = 0
    first_token: threading.Event = field(default_factory=threading.Event)
    text: str = ""
    tokens: list[str] = field(default_factory=list)
    """Each token's own text, from `logprobs` (when the request asked for them)."""
    completion_tokens: int | None = None
    finish_reason: str | None = None
    error: dict[str, object] | None = None
    done: bool = False
    """Streams: the `[DONE]` line arrived."""
    failure: str = ""
    """What went wrong on the client side (a hang: the client timeout; a malformed stream)."""
    seconds: float = 0.0
    ended_at: float = 0.0

    @property
    def ended(self) -> bool:
        return not self.failure and (self.finish_reason is not None or self.error is not None)


def call(base_url: str, payload: dict[str, object], out: Outcome, timeout_s: float) -> None:
    """Run one request to its end; record how it ended (never raises)."""
    t0 = time.monotonic()
    try:
        with httpx.Client(base_url=base_url, timeout=timeout_s) as http:
            if not payload["stream"]:
                r = http.post("/v1/chat/completions", json=payload)
                out.status = r.status_code
                if r.status_code == 200:
                    data = r.json()
                    out.text = data["choices"][0]["message"]["content"]
                    out.tokens = [e["token"] for e in (data["choices"][0].get("logprobs") or {}).get("content", [])]
                    out.finish_reason = data["choices"][0]["finish_reason"]
                    out.completion_tokens = data["usage"]["completion_tokens"]
                else:
                    out.error = assert_openai_error(r.json())
                return
            with http.stream("POST", "/v1/chat/completions", json=payload) as r:
                if r.status_code != 200:
                    out.error = assert_openai_error(json.loads(r.read()))
                    out.status = r.status_code
                    return
                out.status = 200
                for line in r.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line.removeprefix("data: ")
                    if data == "[DONE]":
                        out.done = True
                        break
                    event = json.loads(data)
                    if "error" in event:
                        out.error = assert_openai_error(event)
                        continue
                    if event.get("usage"):
                        out.completion_tokens = event["usage"]["completion_tokens"]
                    for choice in event["choices"]:
                        if choice["delta"].get("content"):
                            out.text += choice["delta"]["content"]
                            out.first_token.set()
                        out.tokens += [e["token"] for e in (choice.get("logprobs") or {}).get("content", [])]
                        out.finish_reason = choice["finish_reason"] or out.finish_reason
                if not out.done:
                    out.failure = "the stream closed without [DONE]"
    except httpx.TimeoutException:
        out.failure = f"no end within the client timeout of {timeout_s}s: a hang"
    except Exception as e:
        out.failure = f"{type(e).__name__}: {e}"
    finally:
        out.ended_at = time.monotonic()
        out.seconds = out.ended_at - t0


def launch(
    base_url: str, payloads: list[dict[str, object]], timeout_s: float
) -> tuple[list[Outcome], list[threading.Thread]]:
    outcomes = [Outcome() for _ in payloads]
    threads = [
        threading.Thread(target=call, args=(base_url, p, o, timeout_s), daemon=True)
        for p, o in zip(payloads, outcomes, strict=True)
    ]
    for t in threads:
        t.start()
    return outcomes, threads


def join(threads: list[threading.Thread], deadline_s: float) -> None:
    end = time.monotonic() + deadline_s
    for t in threads:
        t.join(max(0.0, end - time.monotonic()))
    assert not any(t.is_alive() for t in threads), f"requests still open {deadline_s}s on"


def try_chat(cluster: LocalCluster, model: str) -> bool:
    r = httpx.post(f"{cluster.base_url}/v1/chat/completions", json=body(model, 2, False), timeout=60)
    assert r.status_code in (200, 503), r.text  # only "not there yet" while it comes back
    return r.status_code == 200


SPECIAL = re.compile(r"<\|[a-z_]+\|>")
"""A chat template's special token (`<|im_end|>`): text the detokenizer leaves out."""


def test_scheduler_down_gives_503_with_retry_after_at_once_and_recovers(own_cluster: LocalCluster) -> None:
    register(own_cluster, "f-sched")
    assert try_chat(own_cluster, "f-sched")
    own_cluster.procs["scheduler"].kill()
    try:
        for stream in (False, True):
            t0 = time.monotonic()
            r = httpx.post(f"{own_cluster.base_url}/v1/chat/completions", json=body("f-sched", 4, stream), timeout=30)
            elapsed = time.monotonic() - t0
            assert r.status_code == 503, r.text  # a stream too: placement comes before any byte
            assert elapsed <= 2.0, f"the 503 took {elapsed:.2f}s"
            assert int(r.headers["Retry-After"]) >= 1
            err = assert_openai_error(r.json())
            assert err["type"] == "service_unavailable" and err["code"] == "unavailable"
    finally:
        own_cluster.restart("scheduler")
    # The new scheduler learns the node from its heartbeats; then requests are placed again.
    wait_for(
        lambda: try_chat(own_cluster, "f-sched"), 60, "a request to succeed after the scheduler restart", every_s=0.5
    )


def test_nats_restart_mid_traffic_ends_every_request_and_service_resumes(own_cluster: LocalCluster) -> None:
    register(own_cluster, "f-nats")
    on_the_core(own_cluster, "f-nats")  # the four requests on one engine
    n = 96
    # Two streams; once one decodes, two plain requests join them (the instance serves one at a
    # time, the others wait their turn on the engine): NATS restarts with all four in flight.
    # `logprobs` names each token the engine made, so a lost chunk shows as a missing token.
    # (Re-encoding the text is no count: "Lighthouse" + "era" re-encodes in fewer tokens.)
    counted = {"logprobs": True}
    outcomes, threads = launch(own_cluster.base_url, [body("f-nats", n, True) | counted] * 2, timeout_s=90)
    try:
        wait_for(
            lambda: any(o.first_token.is_set() or o.failure for o in outcomes), 60, "a stream to get its first token"
        )
        more, more_threads = launch(own_cluster.base_url, [body("f-nats", n, False) | counted] * 2, timeout_s=90)
        outcomes, threads = outcomes + more, threads + more_threads
        wait_for(
            lambda: (
                metric(own_cluster, "gateway", "tessera_gateway_inflight_requests") >= 4
                or any(o.ended_at for o in outcomes)
            ),
            30,
            "all four requests to be admitted",
        )
        restarted_at = time.monotonic()
        own_cluster.restart("nats")  # stopped and started: a few hundred ms without a bus
    finally:
        join(threads, 100)
    assert all(o.ended_at > restarted_at for o in outcomes), ("not all in flight", restarted_at, outcomes)

    for o in outcomes:
        assert o.ended, o
        if o.error is None:
            # A completion must be the whole completion: no tokens lost while the bus was away.
            # It holds every token the engine made, each one's text in order. (Not a reference's
            # word for word: on the continuous-batching core, as in vLLM, the batch it ran in and
            # a prompt read from the prefix cache change the arithmetic, and a near-tie, even the
            # first token's, may fall the other way: seen on an AVX512_BF16 machine.)
            assert o.finish_reason == "length" and o.completion_tokens == n, o
            assert len(o.tokens) == n, f"tokens lost in transit: {len(o.tokens)} of {n}\n{o.text!r}"
            if not any("\ufffd" in t for t in o.tokens):  # a token that is part of a character has no text
                # A special token the model made (an end of turn it runs past: the length is
                # fixed) is named in logprobs and has no text (seen when the batch's arithmetic
                # tips the model into one).
                spoken = "".join(t for t in o.tokens if not SPECIAL.fullmatch(t))
                assert spoken == o.text, f"text lost in transit:\n{o.text!r}\n{o.tokens!r}"
        else:
            assert o.status != 200 or o.done, o  # an error event in a stream is followed by [DONE]

    for name, proc in own_cluster.procs.items():
        if proc.http_port is not None:
            wait_for(lambda nm=name: own_cluster.ready(nm), 30, f"{name} to report ready again")
    wait_for(lambda: try_chat(own_cluster, "f-nats"), 60, "a request to succeed after NATS came back", every_s=0.5)


def test_no_admitted_stream_is_left_hanging_when_the_engine_dies_under_a_burst(
    own_cluster: LocalCluster,
) -> None:
    register(own_cluster, "f-burst")
    assert try_chat(own_cluster, "f-burst")
    payloads = [body("f-burst", 2000, True) for _ in range(12)]
    outcomes, threads = launch(own_cluster.base_url, payloads, timeout_s=90)
    try:
        # Every request answered (placed and accepted: 200 and streaming, or refused) and tokens
        # flowing: the engine dies with the whole burst admitted.
        wait_for(
            lambda: all(o.status or o.failure for o in outcomes) and any(o.first_token.is_set() for o in outcomes),
            60,
            "the burst to be admitted and stream its first tokens",
        )
        own_cluster.procs["engine@node-0"].kill()
        killed_at = time.monotonic()
    finally:
        join(threads, 60)
    ended_within = time.monotonic() - killed_at
    assert ended_within < 30, f"the last request ended {ended_within:.1f}s after the engine died"

    for o in outcomes:
        assert o.ended, o
        if o.status == 200:
            assert o.done, o  # completion or error event, then [DONE]
        if o.status == 200 and o.error is not None:  # admitted, then lost with the engine
            assert o.error["type"] == "service_unavailable", o.error
    admitted = sum(o.status == 200 for o in outcomes)
    assert admitted >= 6, f"only {admitted} of 12 streams were admitted before the engine died"

    own_cluster.restart("engine@node-0")
    wait_for(lambda: try_chat(own_cluster, "f-burst"), 60, "a request to succeed on the new engine", every_s=0.5)


class _Delivered:
    """A token-stream subscription that delivers what reached the gateway, and then nothing."""

    def __init__(self, *events: object) -> None:
        self.messages = [SimpleNamespace(data=encode(e)) for e in events]  # type: ignore[arg-type]

    async def next_msg(self, timeout: float) -> object:
        if not self.messages:
            raise NatsTimeout
        return self.messages.pop(0)


async def _relay(*events: object) -> list[object]:
    gen = Generation(Gateway(GatewaySettings(), None, None), None)  # type: ignore[arg-type]
    gen._sub = _Delivered(*events)  # type: ignore[assignment]
    return [e async for e in gen.events()]


async def test_tokens_lost_on_the_bus_end_the_request_with_an_error_not_a_completion_with_a_hole() -> None:
    """In-process, deterministic: the engine's chunks carry token counts and its `Finished` the
    total, so a chunk published while the bus was reconnecting (and dropped by NATS, which keeps
    nothing for a subscriber not yet back) shows as a shortfall at the end. On a real cluster,
    the gateway's NATS connection cut mid-stream: tests/e2e/test_real_faults.py."""
    rid = "r"
    first = TokenChunk(request_id=rid, text="Once upon", tokens=2)
    lost = TokenChunk(request_id=rid, text=" a", tokens=1)
    end = Finished(request_id=rid, finish_reason=FinishReason.LENGTH, prompt_tokens=5, completion_tokens=3)
    whole = await _relay(first, lost, end)
    assert whole[-1] == end
    with pytest.raises(TesseraError) as e:
        await _relay(first, end)  # `lost` never arrived
    assert e.value.status == 503 and "1 of the 3 tokens" in e.value.message

"""Faults that tests/gateway/test_resume.py and test_faults.py drive through fakes, here on real
clusters, the real model and the official client (issue 19, §3):

- no capacity: a node whose memory budget cannot hold the model at all answers a 503
  `no_capacity` with Retry-After at once (it does not wait `TESSERA_MEMORY_WAIT_S` for room
  that can never come);
- resume and its cap: a request whose instance is preempted goes on on the other node from the
  text it had streamed, twice, and its client gets the whole completion, every token once; a
  third preemption reaches the client as a 503 `preempted` (docs/operating.md: "A request moves at most
  twice"; `MAX_RESUMES` is a constant, not a setting). No node preempts one request three
  times on its own, so these preemptions are real `PreemptInstance` orders sent on the real
  bus to the real engines, each once the leg to preempt streams (the same order the scheduler
  sends);
- lost tokens: the gateway's connection to NATS is cut mid-stream (a TCP relay between it
  and NATS drops what the server sends until a chunk of the stream is among it, then closes;
  nats-py reconnects through it), so the engine's chunks published meanwhile never reach the
  gateway; the chunks' token counts fall short of the engine's `Finished`, and the client
  gets an error that says how many tokens were lost, not a completion with a hole;
- scheduler-initiated preemption (LLM-Mesh §7.1, `placement.preemption_for`): nobody sends
  `PreemptInstance` by hand; a request for a bigger instance whose node's decode rounds its
  smaller neighbour lengthens past its TPOT SLO makes the scheduler preempt the neighbour,
  whose request finishes on the other node.

A watcher on the real bus (`tests/helpers/bus_watch.py`) sees what the engines were sent and what they streamed:
each leg of a resumed request, its node, its prompt, its chunks and its end. Tests wait on
conditions with deadlines, never on time. The relay that cuts the gateway's NATS connection is
`tests/helpers/nats_relay.py`.
"""

from __future__ import annotations

import math
import re
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import msgspec
import openai
import pytest

from ops.localcluster import LocalCluster, default_model_path
from policy.placement import Demand, validate
from policy.scheduling import NodeView
from policy.slo import ttft_slo
from shared import subjects
from shared.messages import (
    ErrorCode,
    Failed,
    Finished,
    ModelRecord,
)
from tests.conftest import TEST_ENV, start_cluster
from tests.helpers.background_client import Outcome, complete_in_background
from tests.helpers.bus_watch import Leg, Watch
from tests.helpers.cluster import metric, on_the_core, register, wait_for
from tests.helpers.nats_relay import GatewayBehindProxy, NatsProxy

TTFT_SLO_S, TPOT_SLO_S = 60.0, 5.0
"""SLOs no placement here breaks (but the one the scheduler test tightens on purpose)."""
TOKENS = 160
"""Long enough that no leg ends before the order that ends it lands (that takes one decode
step), on any machine; the last leg generates what is left."""
STREAM_PREFIX = subjects.token_stream("")


def body(model: str, prompt: str, max_tokens: int = TOKENS) -> dict[str, Any]:
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "extra_body": {"ignore_eos": True},
    }


def node_models(c: LocalCluster) -> dict[str, set[str]]:
    status = httpx.get(f"{c.base_url}/admin/instances", timeout=10).json()
    return {n["node_id"]: {i["model"] for i in n["instances"]} for n in status["nodes"]}


def streaming_leg(watch: Watch, prompt: str, index: int) -> Callable[[], Leg | None]:
    """Condition: leg `index` of the request has streamed a token."""

    def check() -> Leg | None:
        legs = watch.legs(prompt)
        return legs[index] if len(legs) > index and legs[index].tokens else None

    return check


def preempt_each_leg(watch: Watch, model: str, prompt: str, times: int) -> None:
    """Preempt the request's instance `times` times, each once its newest leg streams, on the
    node that leg runs on."""
    for i in range(times):
        leg = wait_for(streaming_leg(watch, prompt, i), 120, f"leg {i + 1} of {prompt!r} to stream")
        reply = watch.preempt(leg.node, model)
        assert reply.stopped and reply.reason == "preempted", reply


def engines_preempted(c: LocalCluster) -> float:
    return sum(metric(c, f"engine@node-{i}", "tessera_engine_preemptions_total") for i in range(c.nodes))


# --- fixtures ---------------------------------------------------------------------------------


@dataclass
class Pair:
    c: GatewayBehindProxy
    watch: Watch
    client: openai.OpenAI
    big_source: Path


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory, model_store: Path) -> Iterator[Pair]:
    """Two nodes, the gateway's NATS through a relay. "sm" (the default GGUF) and "big" (a
    copy: another artifact, so another worker; the same bytes as tests/e2e/test_preemption.py's,
    converted once per session) on node-0, "sm2" (the default GGUF again) on node-1. A node
    lost to the gateway for a moment (the cut) is not taken for dead: TESSERA_NODE_TIMEOUT_S."""
    home = tmp_path_factory.mktemp("realfaults")
    big = home / "big.gguf"
    shutil.copyfile(default_model_path(), big)
    with big.open("ab") as f:
        f.write(b"\x00tessera-test-big")
    c = GatewayBehindProxy(
        home=home,
        store=model_store,
        nodes=2,
        env={**TEST_ENV, "TESSERA_NODE_TIMEOUT_S": "10", "TESSERA_MAX_INFLIGHT": "16"},
    )
    c.proxy = NatsProxy(c.nats_port)
    watch: Watch | None = None
    try:
        c.start(timeout_s=90)
        watch = Watch(c.nats_url)
        for name, source in (("sm", default_model_path()), ("sm2", default_model_path()), ("big", big)):
            register(c, name, keep_alive_s=600.0, source=str(source), ttft_slo_s=TTFT_SLO_S, tpot_slo_s=TPOT_SLO_S)
        client = openai.OpenAI(base_url=f"{c.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
        # First starts go to the node with the fewest instances (node-0 on a tie).
        for name in ("sm", "sm2", "big"):
            client.completions.create(model=name, prompt="Hello", max_tokens=2)
        # On their continuous-batching cores: no tier-up (seconds of CPU) beside what follows.
        for name in ("sm", "sm2", "big"):
            on_the_core(c, name)
        yield Pair(c, watch, client, big)
    finally:
        if watch is not None:
            watch.close()
        c.stop()
        c.proxy.close()


@pytest.fixture
def no_room(tmp_path_factory: pytest.TempPathFactory, model_store: Path) -> Iterator[LocalCluster]:
    """One node whose memory budget (1 MiB) cannot hold the model's weights; a start may wait
    600 s for room (`TESSERA_MEMORY_WAIT_S`): a refusal that waited would not come within the
    client's timeout."""
    c = start_cluster(
        tmp_path_factory.mktemp("noroom"),
        model_store,
        TESSERA_MEMORY_BUDGET_BYTES=str(1 << 20),
        TESSERA_MEMORY_WAIT_S="600",
    )
    try:
        register(c, "sm", keep_alive_s=600.0, ttft_slo_s=TTFT_SLO_S, tpot_slo_s=TPOT_SLO_S)
        yield c
    finally:
        c.stop()


# --- 1. no capacity ---------------------------------------------------------------------------


def test_a_node_that_cannot_hold_the_model_answers_503_no_capacity_at_once(no_room: LocalCluster) -> None:
    c = no_room
    with httpx.Client(base_url=c.base_url, timeout=60) as http:
        for stream in (False, True):
            r = http.post(
                "/v1/chat/completions",
                json={
                    "model": "sm",
                    "messages": [{"role": "user", "content": "Hi"}],
                    "max_tokens": 4,
                    "stream": stream,
                },
            )
            # A stream too: placement (and so the start) comes before its first byte.
            assert r.status_code == 503, r.text
            assert int(r.headers["Retry-After"]) >= 1
            err = r.json()["error"]
            assert err["type"] == "service_unavailable" and err["code"] == "no_capacity", err
            assert "memory budget" in err["message"] and str(1 << 20) in err["message"], err
    # Refused, nothing held, nothing left starting: the node is as it was.
    assert metric(c, "memory_manager@node-0", "tessera_memory_denied_total") >= 2
    assert metric(c, "memory_manager@node-0", "tessera_memory_used_bytes") == 0

    seen: list[dict[str, Any]] = []

    def settled() -> dict[str, Any] | None:
        # The cluster status is the nodes' last heartbeats: one sent while the refused start
        # was under way still shows it, until the next (every 0.5 s) comes.
        seen[:] = [httpx.get(f"{c.base_url}/admin/instances", timeout=10).json()]
        status = seen[0]
        nodes_idle = all(not n["instances"] and not n["starting"] for n in status["nodes"])
        return status if status["starting"] == [] and nodes_idle else None

    wait_for(settled, 10, "a heartbeat with nothing on the node, nothing starting", detail=lambda: seen)


# --- 2. resume, and its cap -------------------------------------------------------------------


def test_a_request_preempted_twice_goes_on_from_its_text_and_its_client_gets_every_token_once(
    pair: Pair,
) -> None:
    c, watch = pair.c, pair.watch
    prompt = "[resume-twice] Tell me about the sea, the ships on it and the people on the ships."
    resumed = metric(c, "gateway", "tessera_gateway_resumed_total")
    preempted = engines_preempted(c)
    out = complete_in_background(pair.client, True, **body("sm2", prompt))
    preempt_each_leg(watch, "sm2", prompt, times=2)
    out.ended(180)
    assert out.error is None, out.error
    assert out.finish_reason == "length" and out.completion_tokens == TOKENS, out

    legs = watch.ended_legs(prompt, 3)
    # Each leg on the other node than the one before it, each preempted leg ended there as
    # such, the last one finished.
    assert legs[0].node != legs[1].node != legs[2].node, [leg.node for leg in legs]
    assert [type(leg.end).__name__ for leg in legs] == ["Failed", "Failed", "Finished"]
    assert all(leg.end.code == ErrorCode.PREEMPTED for leg in legs[:2])  # type: ignore[union-attr]
    # Each leg went on from the text streamed before it, for the tokens left.
    for i, leg in enumerate(legs):
        assert leg.request.prompt == prompt + "".join(before.text for before in legs[:i])
        assert leg.request.params.max_tokens == TOKENS - sum(before.tokens for before in legs[:i])
    # The client got exactly what the engines generated, in order: nothing twice, nothing lost.
    assert out.text == "".join(leg.text for leg in legs)
    assert sum(leg.tokens for leg in legs) == TOKENS
    assert metric(c, "gateway", "tessera_gateway_resumed_total") == resumed + 2
    assert engines_preempted(c) == preempted + 2


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "plain"])
def test_a_third_preemption_of_one_request_reaches_its_client_as_a_503_preempted(pair: Pair, stream: bool) -> None:
    c, watch = pair.c, pair.watch
    prompt = f"[resume-cap-{stream}] Tell me about the sea, the ships on it and the people on the ships."
    resumed = metric(c, "gateway", "tessera_gateway_resumed_total")
    out = complete_in_background(pair.client, stream, **body("sm2", prompt))
    preempt_each_leg(watch, "sm2", prompt, times=3)
    out.ended(180)

    assert out.error is not None, out
    assert out.error["type"] == "service_unavailable" and out.error["code"] == "preempted", out.error
    if stream:
        # The error event ends a stream whose text had come: the text of every leg, once.
        assert out.status is None and out.finish_reason is None and out.completion_tokens is None
        assert out.text == "".join(leg.text for leg in watch.ended_legs(prompt, 3))
    else:
        assert out.status == 503 and out.retry_after is not None and int(out.retry_after) >= 1, out
    legs = watch.ended_legs(prompt, 3)
    assert len(legs) == 3 and all(isinstance(leg.end, Failed) for leg in legs), [leg.end for leg in legs]
    assert all(leg.end.code == ErrorCode.PREEMPTED for leg in legs)  # type: ignore[union-attr]
    # Moved twice (the cap), not a third time.
    assert metric(c, "gateway", "tessera_gateway_resumed_total") == resumed + 2


# --- 3. tokens lost between the engine and the gateway ------------------------------------------


def test_tokens_lost_on_the_way_to_the_gateway_end_the_stream_with_an_error_saying_how_many(pair: Pair) -> None:
    c, watch, client = pair.c, pair.watch, pair.client
    # Sized so that decoding outlasts the gateway's reconnection (0.5 s between tries) many
    # times on this machine, whatever its speed: ~6 s of decoding at the rate measured here.
    t0 = time.monotonic()
    client.completions.create(**body("sm2", "Count to fifty.", max_tokens=32))
    tokens = min(max(int(32 / (time.monotonic() - t0) * 6), TOKENS), 3000)

    prompt = "[lost] Tell me about the sea, the ships on it and the people on the ships."
    out = complete_in_background(client, True, **body("sm2", prompt, max_tokens=tokens))
    wait_for(lambda: out.text or out.done.is_set(), 120, "the stream's first text")
    cut = c.proxy.cut(STREAM_PREFIX)
    assert cut.closed.wait(60), "no chunk of the stream reached the cut connection"
    assert cut.resubscribed.wait(60), "the gateway did not subscribe to its stream again"
    out.ended(180)

    (leg,) = watch.ended_legs(prompt, 1)
    assert isinstance(leg.end, Finished) and leg.end.completion_tokens == tokens, leg.end
    assert leg.ended_at > cut.resubscribed_at, "the engine finished before the gateway was back: make it longer"
    # The engine generated every token; the gateway saw fewer, and says so.
    assert out.error is not None, f"a completion with a hole passed as whole: {out}"
    assert out.error["type"] == "service_unavailable" and out.error["code"] == "unavailable", out.error
    found = re.search(r"(\d+) of the (\d+) tokens generated were lost", out.error["message"])
    assert found, out.error["message"]
    lost, total = int(found[1]), int(found[2])
    assert total == tokens and lost >= sum(ch.tokens for ch in cut.dropped) >= 1
    assert out.finish_reason is None and out.completion_tokens is None  # no finish, no usage
    # What the client got is the stream with exactly that hole: chunks up to the cut, then
    # from the reconnection on.
    chunks = leg.chunks
    holes = [
        (a, b)
        for a in range(len(chunks) + 1)
        for b in range(a + 1, len(chunks) + 1)
        if "".join(ch.text for ch in chunks[:a] + chunks[b:]) == out.text
        and sum(ch.tokens for ch in chunks[a:b]) == lost
    ]
    assert holes, "the client's text is not the stream less the lost chunks"
    # The gateway is back on the bus: the next request is served whole.
    r = client.completions.create(**body("sm2", "Hello", max_tokens=4))
    assert r.choices[0].finish_reason == "length" and r.usage is not None and r.usage.completion_tokens == 4


# --- 4. preemption the scheduler decides -------------------------------------------------------


def records(c: LocalCluster) -> list[ModelRecord]:
    return [msgspec.convert(r, ModelRecord) for r in httpx.get(f"{c.base_url}/admin/models", timeout=10).json()]


def test_the_scheduler_preempts_a_smaller_neighbour_crowding_a_bigger_batch_and_its_request_finishes_elsewhere(
    pair: Pair,
) -> None:
    """LLM-Mesh §7.1 as `scheduling._place_validated` runs it: "big" has a request on node-0
    and "sm" one beside it; a second request for big validates there only without sm's decode
    iterations in each round (big's TPOT SLO, an operator's registration, is set between the
    two, read off the performance models the scheduler fits from the engines' reports); sm's
    requests validate on node-1. The scheduler preempts sm, the request joins big, and sm's
    request goes on on node-1. The test sends no PreemptInstance."""
    c, watch, client = pair.c, pair.watch, pair.client
    layout = wait_for(
        lambda: m if {"sm", "big"} <= (m := node_models(c)).get("node-0", set()) else None, 30, "sm and big on node-0"
    )
    assert "big" not in layout.get("node-1", set()), layout
    # Both measured on their cores (what the scheduler's performance models are fitted from).
    for name in ("sm", "big"):
        client.completions.create(**body(name, "Hello there", max_tokens=4))
    wait_for(
        lambda: metric(c, "scheduler", "tessera_scheduler_profiled_models") >= 3, 30, "the scheduler's measurements"
    )
    orders = len(watch.preempts)
    ordered = metric(c, "scheduler", "tessera_scheduler_preemptions_total")
    resumed = metric(c, "gateway", "tessera_gateway_resumed_total")

    # sm's request, then big's first, side by side on node-0 (with the loose SLOs both join
    # there), taking turns: sm's is long enough to be running still when big's second request
    # comes, on a fast machine too (the test says so if not).
    long = 4 * TOKENS
    small_prompt = "[neighbour] Tell me about the sea, the ships on it and the people on the ships."
    first_prompt = "[big-1] Tell me about the sea, the ships on it and the people on the ships."
    small = complete_in_background(client, True, **body("sm", small_prompt, max_tokens=long))
    first = Outcome()
    first.done.set()  # until it is sent
    try:
        wait_for(streaming_leg(watch, small_prompt, 0), 120, "sm's request to stream")
        first = complete_in_background(client, True, **body("big", first_prompt, max_tokens=long))
        wait_for(lambda: watch.legs(first_prompt), 120, "big's first request to reach its engine")
        assert watch.legs(small_prompt)[0].node == "node-0" and watch.legs(first_prompt)[0].node == "node-0"

        # big's TPOT SLO (an operator's registration) between the rounds a second request for
        # big would see on node-0 with sm's iterations in them and without: it validates there
        # only alone. Read as the scheduler reads them, from node-0's latest heartbeat (both
        # with a request running) and the performance models fitted from the engines'
        # reports; these change with every report, so the SLO is set again until it still
        # lies between the two once set.
        second_prompt = "[big-2] Tell me about the sea, the ships on it and the people on the ships."
        by_name = {r.name: r for r in records(c)}
        r = httpx.post(f"{c.base_url}/tokenize", json={"model": "big", "prompt": second_prompt}, timeout=10)
        prompt_tokens = int(r.json()["count"])
        demand = Demand(prompt_tokens, 16, ttft_slo(by_name["big"], prompt_tokens), math.inf)

        seen: list[object] = []

        def rounds() -> tuple[float, float] | None:
            s = watch.status.get("node-0")
            running = {i.model: i.running for i in s.instances} if s else {}
            if s is None or running.get("sm", 0) < 1 or running.get("big", 0) < 1:
                seen[:] = [running]
                return None
            profiles, node = watch.perf.profiles(by_name.values()), NodeView.from_status(s)
            crowded = validate(node, "big", demand, profiles).round_s
            alone = validate(node, "big", demand, profiles, without=frozenset({"sm"})).round_s
            seen[:] = [running, crowded, alone, {m: p.perf for m, p in profiles.items()}]
            # sm's iterations a clear part of the round (same bytes as big's, but measured
            # apart: their fitted costs differ by the noise of their own measurements).
            return (crowded, alone) if crowded > 1.25 * alone > 0 else None

        def set_big_tpot_slo(tpot_slo_s: float) -> None:  # an operator's registration, replaced
            register(
                c,
                "big",
                keep_alive_s=600.0,
                replace=True,
                source=str(pair.big_source),
                ttft_slo_s=TTFT_SLO_S,
                tpot_slo_s=tpot_slo_s,
            )

        def tpot_set_between() -> float | None:
            crowded, alone = wait_for(
                rounds, 60, "node-0 busy with sm and big, and rounds measured for both", detail=lambda: seen
            )
            tpot = math.sqrt(crowded * alone)
            set_big_tpot_slo(tpot)
            now = rounds()
            return tpot if now is not None and now[1] < tpot < now[0] else None

        try:
            wait_for(tpot_set_between, 90, "big's TPOT SLO set between the two rounds")
            assert not small.done.is_set() and not first.done.is_set(), "a request ended early: make them longer"
            second = complete_in_background(client, True, **body("big", second_prompt, max_tokens=16)).ended(120)
        finally:
            set_big_tpot_slo(TPOT_SLO_S)
        small.ended(180)
    finally:
        first.stop.set()  # big's first request has served its purpose: its client leaves
        small.stop.set()  # (ended already, unless the test failed before)
        first.done.wait(60)

    # The scheduler ordered it, once: sm on node-0, for big.
    assert [(n, p.model, p.for_model) for n, p in watch.preempts[orders:]] == [("node-0", "sm", "big")]
    assert metric(c, "scheduler", "tessera_scheduler_preemptions_total") == ordered + 1
    assert metric(c, "gateway", "tessera_gateway_resumed_total") == resumed + 1
    # big's requests both ran on node-0; the second one (the one placed by preempting) whole.
    assert second.error is None and second.completion_tokens == 16, second
    assert first.ended(0).error is None, first
    for p in (first_prompt, second_prompt):
        assert [leg.node for leg in watch.legs(p)] == ["node-0"]
    # sm's request: preempted on node-0, finished on node-1 from its text so far, every token once.
    assert small.error is None and small.finish_reason == "length" and small.completion_tokens == long, small
    legs = watch.ended_legs(small_prompt, 2)
    assert [leg.node for leg in legs] == ["node-0", "node-1"], [(leg.node, leg.end) for leg in legs]
    assert isinstance(legs[0].end, Failed) and legs[0].end.code == ErrorCode.PREEMPTED
    assert isinstance(legs[1].end, Finished)
    assert legs[1].request.prompt == small_prompt + legs[0].text
    assert small.text == legs[0].text + legs[1].text and legs[0].tokens + legs[1].tokens == long
    wait_for(lambda: "sm" not in node_models(c).get("node-0", set()), 30, "sm unloaded from node-0")
    assert "sm" in node_models(c).get("node-1", set())

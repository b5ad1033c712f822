"""Progress in the stream at the gateway (issue 35, part 4): the comment lines, their
percentage that never goes back, which starts a request waits on, and `/v1/models` states."""

from __future__ import annotations

import time

import pytest

from services.gateway.loading import Lines, Placing, StartWatch, comment, eta_left, model_states, percent
from shared.messages import ClusterStatus, InstanceView, NodeStatus, StartProgress


def event(phase: str, done: int, total: int, eta: float | None = None, model: str = "m") -> StartProgress:
    return StartProgress(
        node_id="n", model=model, started_at=1.0, phase=phase, done_bytes=done, total_bytes=total, eta_s=eta
    )


def test_the_comment_line_is_an_sse_comment_in_the_contract_format() -> None:
    assert comment("load", 41, 1.25) == ": tessera loading phase=load 41% eta=1.2s\n\n"
    assert comment("init", 0, None) == ": tessera loading phase=init 0% eta=?\n\n"
    assert comment("load", 41, 1.25).startswith(":")  # a comment every SSE client ignores


def test_percent_and_eta_left() -> None:
    assert percent(0, 0) == 0 and percent(41, 100) == 41 and percent(999, 1000) == 99
    assert percent(150, 100) == 100 and percent(-5, 100) == 0
    assert eta_left(None, 3.0) is None
    assert eta_left(2.0, 0.5) == pytest.approx(1.5) and eta_left(2.0, 5.0) == 0.0


def test_a_streams_percentage_never_goes_back() -> None:
    lines = Lines()
    assert "phase=load 60%" in lines.line(event("load", 60, 100, 1.0))
    # Another start of the model (or a retried one) reports less: the stream stays at 60.
    assert "phase=init 60%" in lines.line(event("init", 0, 0))
    assert "phase=load 60%" in lines.line(event("load", 30, 100, 2.0))
    assert "phase=ready 100% eta=0.0s" in lines.line(event("ready", 100, 100, 0.0))


def test_only_a_start_the_request_is_being_placed_on_and_heard_since_it_began_counts() -> None:
    watch = StartWatch()
    watch.heard(event("ready", 100, 100, model="m"))  # an earlier start's last event
    placing = Placing(since=time.monotonic())
    placing.models["m"] += 1
    assert watch.under_way(placing) is None
    watch.heard(event("init", 0, 0, model="other"))
    assert watch.under_way(placing) is None
    watch.heard(event("init", 0, 0, model="m"))
    seen = watch.under_way(placing)
    assert seen is not None and seen[0].phase == "init"
    placing.models["m"] -= 1  # its placement was answered (warm, or refused): no more lines
    assert watch.under_way(placing) is None


def test_model_states_from_the_schedulers_view() -> None:
    inst = InstanceView(model="up", active=0, last_used=0.0, loaded_at=0.0)
    status = ClusterStatus(
        nodes=(
            NodeStatus(node_id="a", sent_at=0.0, instances=(inst,), starting=("node-start",)),
            NodeStatus(node_id="b", sent_at=0.0, instances=()),
        ),
        starting=("starting", "up"),  # a scale-out of a running model: loaded
    )
    assert model_states(status) == {"up": "loaded", "starting": "loading", "node-start": "loading"}


def test_a_request_joining_a_start_under_way_hears_its_last_event() -> None:
    watch = StartWatch()
    watch.heard(event("load", 40, 100, model="m"))  # before the request: the start goes on
    placing = Placing(since=time.monotonic())
    placing.models["m"] += 1
    seen = watch.under_way(placing)
    assert seen is not None and seen[0].done_bytes == 40
    watch.heard(event("failed", 40, 100, model="m"))
    late = Placing(since=time.monotonic() + 1)  # a request after the start ended
    late.models["m"] += 1
    assert watch.under_way(late) is None

"""A request's cold-start budget (issue 35): the predicted start against the budget, and the
load-time model it comes from (measured starts, else by size, else a guess)."""

from __future__ import annotations

import pytest

from policy.cold_budget import forecast, refusal, warm_instead
from policy.perf_book import PerfBook
from policy.placement import OVERESTIMATE, RESIDENT_START_S
from policy.scheduling import NodeView
from services.scheduler.routing import read_back_starts
from shared.messages import ColdStartPhases, ColdStartRecorded, ErrorCode, InstanceView, ModelRecord
from shared.registry import Registry
from tests.helpers.records import RECORD


def test_a_measured_start_longer_than_the_budget_is_refused_with_the_predicted_ready_time() -> None:
    f = forecast(load_s=3.0, guess_s=99.0)
    assert f.ready_in_s == pytest.approx(OVERESTIMATE * 3.0) and f.basis == "measured"
    r = refusal("big", f, budget_s=2.0)
    assert r is not None and r.code is ErrorCode.MODEL_STARTING
    assert r.retry_after_s == pytest.approx(f.ready_in_s)
    assert "big" in r.message and "3.30 s" in r.message and "2 s" in r.message


def test_a_start_within_the_budget_or_no_budget_waits() -> None:
    f = forecast(load_s=1.0, guess_s=99.0)
    assert refusal("m", f, budget_s=2.0) is None
    assert refusal("m", forecast(load_s=60.0, guess_s=1.0), budget_s=None) is None


def test_a_budget_of_zero_refuses_any_start() -> None:
    assert refusal("m", forecast(load_s=None, guess_s=0.5, resident=True), budget_s=0.0) is not None


def test_resident_weights_start_at_once_whatever_the_load_measured() -> None:
    f = forecast(load_s=30.0, guess_s=99.0, resident=True, prewarmed=False, spawn_s=5.0)
    assert f.ready_in_s == pytest.approx(OVERESTIMATE * RESIDENT_START_S) and f.basis == "resident"


def test_no_prewarmed_worker_adds_the_spawn() -> None:
    f = forecast(load_s=2.0, guess_s=99.0, prewarmed=False, spawn_s=1.5)
    assert f.ready_in_s == pytest.approx(OVERESTIMATE * 3.5)


def test_a_start_under_way_counts_what_it_has_done_and_the_queue_ahead() -> None:
    # 4 s expected, 3 s done; two requests wait ahead, 0.25 s of prefill each.
    f = forecast(load_s=4.0, guess_s=99.0, elapsed_s=3.0, waiting=2, prefill_s=0.25)
    assert f.ready_in_s == pytest.approx(OVERESTIMATE * (1.0 + 0.5))
    overdue = forecast(load_s=4.0, guess_s=99.0, elapsed_s=10.0)
    assert overdue.ready_in_s == 0.0


def test_a_never_measured_model_is_predicted_by_the_guess_and_says_so() -> None:
    f = forecast(load_s=None, guess_s=5.0)
    assert f.basis == "guessed" and f.ready_in_s == pytest.approx(OVERESTIMATE * 5.0)
    r = refusal("m", f, budget_s=1.0)
    assert r is not None and "guess" in r.message


def test_over_budget_for_a_scale_out_it_queues_on_the_least_busy_running_instance() -> None:
    def node(node_id: str, active: int | None) -> NodeView:
        insts = {} if active is None else {"m": InstanceView(model="m", active=active, last_used=0.0, loaded_at=0.0)}
        return NodeView(node_id, 0.0, insts)

    assert warm_instead("m", [node("a", 3), node("b", 1), node("c", None)], max_active_per_instance=4) == "b"
    assert warm_instead("m", [node("a", 4), node("c", None)], max_active_per_instance=4) is None
    assert warm_instead("m", [node("c", None)], max_active_per_instance=4) is None


def test_the_load_time_model_is_the_measured_median_else_by_size_else_unknown() -> None:
    book = PerfBook()
    assert book.load_s("a", weight_bytes=100) is None
    for seconds in (1.0, 9.0, 2.0):
        book.start("a", seconds, weight_bytes=100)
    assert book.load_s("a", weight_bytes=100) == 2.0
    # Never started: its size at the others' median seconds per byte (2 s per 100 bytes).
    assert book.load_s("b", weight_bytes=300) == pytest.approx(6.0)
    assert book.load_s("b") is None  # no size to scale by


class LoggedRegistry(Registry):
    """The registry's model and cold-start log, as a restarted scheduler reads them back."""

    def __init__(self, starts: list[ColdStartRecorded]) -> None:
        self.starts = starts

    async def all(self) -> list[ModelRecord]:
        return [RECORD]

    async def cold_starts(self, limit: int = 50) -> list[ColdStartRecorded]:
        return self.starts[:limit]


def logged(model: str, load_s: float, source: str = "store") -> ColdStartRecorded:
    phases = ColdStartPhases(init_s=0.0, load_s=load_s, profile_s=0.0)
    return ColdStartRecorded(node_id="n", model=model, started_at=0.0, phases=phases, total_s=load_s, source=source)


async def test_a_restarted_scheduler_predicts_starts_from_the_cold_start_log() -> None:
    book = PerfBook()
    log = [logged("m", 2.0), logged("m", 0.01, source="resident"), logged("gone", 9.0), logged("m", 4.0)]
    assert await read_back_starts(LoggedRegistry(log), book) == 2  # a resident start loads nothing
    assert book.load_s(RECORD.artifact.artifact_id) == 3.0

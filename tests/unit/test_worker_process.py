"""The worker's command loop on its failure paths, over a real pipe, with no model: a queued
request cancelled, a request with no model loaded, and a batch whose generation raises."""

from __future__ import annotations

import multiprocessing
from collections.abc import Iterator

import pytest

from services.engine.worker_process import _Loop
from services.engine.worker_wire import CancelRun, Done, Failure, Run, Started
from shared.messages import Artifact, FinishReason, SamplingParams


def run(request_id: str) -> Run:
    return Run(request_id, "m", (1, 2, 3), SamplingParams(max_tokens=4, temperature=0.0), 0.0)


class FailingBatcher:
    """Stands in for `instance.Batcher`: its generation raises, as a runtime error would."""

    def __init__(self) -> None:
        self.names: set[str] = set()
        self.loaded = type(
            "Loaded",
            (),
            {
                "artifact": Artifact(
                    artifact_id="a",
                    path="/a",
                    source_sha256="s",
                    context_length=64,
                    kv_bytes_per_token=1,
                    weight_bytes=1,
                )
            },
        )()

    def generate(self, *args: object, **kwargs: object) -> list[object]:
        raise RuntimeError("the runtime failed")


def answer(engine: multiprocessing.connection.Connection) -> object:
    """The worker's next message; a missing one fails the test instead of hanging it."""
    assert engine.poll(5), "the worker sent no answer"
    return engine.recv()


@pytest.fixture
def loop() -> Iterator[tuple[_Loop, multiprocessing.connection.Connection]]:
    engine_end, worker_end = multiprocessing.Pipe()
    yield _Loop(worker_end, None, "CPU", 1, max_batch=4), engine_end  # type: ignore[arg-type]
    engine_end.close()
    worker_end.close()


def test_a_cancelled_queued_request_ends_at_once_and_leaves_the_queue(loop) -> None:
    worker, engine = loop
    worker._handle(run("a"))
    worker._handle(run("b"))
    worker._handle(CancelRun("a"))
    done = answer(engine)
    assert isinstance(done, Done) and done.request_id == "a" and done.finish_reason == FinishReason.CANCELLED
    assert [r.request_id for r in worker.queue] == ["b"]
    worker._handle(CancelRun("unknown"))  # already ended: nothing to answer
    assert not engine.poll(0)


def test_requests_without_a_loaded_model_fail_each(loop) -> None:
    worker, engine = loop
    worker._handle(run("a"))
    worker._handle(run("b"))
    worker._run_batch()
    answers = [answer(engine), answer(engine)]
    assert all(isinstance(a, Failure) for a in answers)
    assert {a.request_id for a in answers} == {"a", "b"} and not worker.queue


def test_a_failing_batch_fails_every_row_and_the_worker_goes_on(loop) -> None:
    worker, engine = loop
    worker.batcher = FailingBatcher()  # type: ignore[assignment]
    worker._handle(run("a"))
    worker._handle(run("b"))
    worker._run_batch()
    started = [answer(engine), answer(engine)]
    assert all(isinstance(s, Started) and s.batch == 2 for s in started)
    failures = [answer(engine), answer(engine)]
    assert all(isinstance(f, Failure) and "the runtime failed" in f.message for f in failures)
    assert {f.request_id for f in failures} == {"a", "b"}
    assert not worker.running and not worker.queue


def test_a_core_request_s_gate_deadline_moves_on_with_the_tokens_it_generated() -> None:
    """The worker waits at the node's headroom gate with its most urgent request's deadline
    (eq. 1). A request on the continuous-batching core counts its generated tokens as a row
    does: held at its first token's deadline, one instance decoding kept every turn."""
    from types import SimpleNamespace

    from services.engine.worker_process import _Loop
    from services.engine.worker_wire import Run
    from shared.messages import SamplingParams

    run = Run("a", "s", (1, 2), SamplingParams(max_tokens=8), 0.1, received_at=100.0, ttft_slo_s=1.0, tpot_slo_s=0.05)
    core = SimpleNamespace(generated=lambda rid: {"a": 40}.get(rid, 0))
    loop = SimpleNamespace(running={}, emitted={}, in_core={"a": (run, 0.0)}, engine=core)
    assert _Loop._deadline(loop) == 100.0 + 1.0 + 0.05 * 40  # type: ignore[arg-type]

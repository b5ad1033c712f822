"""The worker loop (`services/engine/worker_loop.py`) over a real pipe, on a fake batch and
binding (`tests/helpers/fake_batch.py`: no model) whose steps are scripted or made by hand, as
vLLM's scheduler tests are: requests queue and join the batch; a cancel before the batch saw a
request ends it at once, after, ends its computation too; the `Done` figures are the loop's
(tokens, the gate's waits kept out of prefill and decode, the widest batch); a request that
fails, fails alone; a batch that raised or died is made anew through the binding; a `Load`
replaces the model and fails what the old one held; every command is answered."""

from __future__ import annotations

import multiprocessing
from collections.abc import Iterator
from multiprocessing.connection import Connection
from pathlib import Path

import pytest

from services.engine.batch_types import Step
from services.engine.worker_loop import WorkerLoop
from services.engine.worker_wire import (
    CancelRun,
    Chunks,
    Done,
    DropSession,
    Failure,
    Load,
    Loaded,
    Run,
    Started,
    TieredUp,
    TierUpNow,
)
from shared.messages import Artifact, FinishReason, SamplingParams, Tier
from tests.helpers.fake_batch import FakeBatch, FakeBinding

WHOLE = "one two three four é! five"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def run(request_id: str, max_tokens: int = 4, prompt: tuple[int, ...] = (7, 8, 9), **params: object) -> Run:
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, **params)  # type: ignore[arg-type]
    return Run(request_id, "s", prompt, sampling, 0.0)


def load(tmp_path: Path) -> Load:
    return Load(Artifact("a", str(tmp_path), "s", 2048, 1, 1), cores=None)


def messages(engine: Connection) -> list[object]:
    out = []
    while engine.poll(0):
        out.append(engine.recv())
    return out


def text_of(msgs: list[object], request_id: str) -> str:
    return "".join(c.text for m in msgs if isinstance(m, Chunks) for c in m.items if c.request_id == request_id)


def dones(msgs: list[object]) -> dict[str, Done]:
    return {m.request_id: m for m in msgs if isinstance(m, Done)}


def failures(msgs: list[object]) -> dict[str | None, str]:
    return {m.request_id: m.message for m in msgs if isinstance(m, Failure)}


def settle(loop: WorkerLoop, clock: Clock) -> None:
    """Turn the loop until nothing runs (each turn a step; the clock moves on so text is due)."""
    for _ in range(50):
        loop.turn(0.0)
        clock.now += 1.0
        if not loop.live and not loop.queue:
            return
    raise AssertionError("requests never ended")


@pytest.fixture
def worker(tmp_path: Path) -> Iterator[tuple[WorkerLoop, Connection, FakeBinding, Clock]]:
    engine_end, worker_end = multiprocessing.Pipe()
    binding, clock = FakeBinding(), Clock()
    loop = WorkerLoop(worker_end, binding, threads=4, clock=clock)
    loop.handle(load(tmp_path))
    assert messages(engine_end) == [Loaded(loaded_from_cache=True, load_s=0.0, threads=4)]
    yield loop, engine_end, binding, clock
    engine_end.close()
    worker_end.close()


def test_a_request_queues_joins_the_batch_streams_its_text_and_ends_with_honest_counts(worker) -> None:
    loop, engine, binding, clock = worker
    loop.handle(run("a", max_tokens=20))
    assert list(loop.queue) and not binding.batch.added  # queued until the loop's next turn
    settle(loop, clock)
    msgs = messages(engine)
    assert msgs[0] == Started("a", 1)
    assert text_of(msgs, "a") == WHOLE
    assert sum(c.tokens for m in msgs if isinstance(m, Chunks) for c in m.items) == 9
    done = msgs[-1]
    assert isinstance(done, Done)
    assert (done.finish_reason, done.completion_tokens, done.prompt_tokens) == (FinishReason.STOP, 9, 3)
    assert done.first_token_at is not None and done.batch == 1 and done.prefill_tokens == 3
    assert (done.kv_allocated_bytes, done.device_bytes) == (4096, 1 << 20)  # for the node's true-up


def test_max_tokens_ends_a_request_on_length(worker) -> None:
    loop, engine, _, clock = worker
    loop.handle(run("a", max_tokens=2))
    settle(loop, clock)
    msgs = messages(engine)
    assert text_of(msgs, "a") == "one two"
    assert (dones(msgs)["a"].finish_reason, dones(msgs)["a"].completion_tokens) == (FinishReason.LENGTH, 2)


def test_the_gate_s_waits_are_kept_out_of_prefill_and_decode_and_the_widest_batch_is_reported(worker) -> None:
    loop, engine, binding, clock = worker
    batch = binding.batch
    loop.handle(run("a"))
    loop.turn(0.0)
    loop.handle(run("b"))
    loop.turn(0.0)  # b joins; one look gives both a token
    batch.hand.append([Step("a", ((3, None),), None, prefill_tokens=12), Step("b", ((2, None),))])
    clock.now += 10.0
    batch.waited += 4.0  # four of those ten seconds waited for the gate
    loop.turn(0.0)
    clock.now += 10.0
    batch.waited += 6.0
    batch.hand.append([Step("a", ((4, None),), FinishReason.LENGTH), Step("b", (), FinishReason.STOP)])
    loop.turn(0.0)
    done = dones(messages(engine))
    a, b = done["a"], done["b"]
    assert (a.completion_tokens, b.completion_tokens) == (4, 2)
    assert a.batch == 2 and b.batch == 2
    assert a.prefill_tokens == 12 and b.prefill_tokens == 3  # what a padding batch said it computed
    assert a.gated_s == 10.0 and a.decode_s == 10.0  # 20 s after its first token, 10 of them at the gate
    assert a.prefill_s == 0.0


def test_a_cancel_before_the_batch_saw_the_request_ends_it_at_once(worker) -> None:
    loop, engine, binding, clock = worker
    engine.send(run("a"))
    engine.send(CancelRun("a"))
    loop.read_commands()
    settle(loop, clock)
    msgs = messages(engine)
    (done,) = msgs
    assert isinstance(done, Done)
    assert (done.finish_reason, done.completion_tokens, done.prompt_tokens) == (FinishReason.CANCELLED, 0, 3)
    assert binding.batch.added == []


def test_a_cancel_after_the_start_ends_its_computation_and_not_its_neighbours(worker) -> None:
    loop, engine, binding, clock = worker
    loop.handle(run("a"))
    loop.handle(run("b"))
    loop.turn(0.0)
    clock.now += 1.0
    loop.turn(0.0)
    loop.handle(CancelRun("a"))
    settle(loop, clock)
    msgs = messages(engine)
    done = dones(msgs)
    assert (done["a"].finish_reason, done["a"].completion_tokens) == (FinishReason.CANCELLED, 2)
    assert binding.batch.cancelled == ["a"]
    assert text_of(msgs, "b") == "one two three four" and done["b"].finish_reason is FinishReason.LENGTH


def test_a_stop_string_ends_the_request_and_its_computation(worker) -> None:
    loop, engine, binding, clock = worker
    loop.handle(run("a", max_tokens=20, stop=(" three",)))
    settle(loop, clock)
    msgs = messages(engine)
    assert text_of(msgs, "a") == "one two"
    done = msgs[-1]
    assert isinstance(done, Done) and (done.finish_reason, done.completion_tokens) == (FinishReason.STOP, 3)
    assert binding.batch.cancelled == ["a"] and not binding.batch.requests


def test_a_failed_request_fails_alone_after_its_text(worker) -> None:
    loop, engine, binding, clock = worker
    loop.handle(run("a"))
    loop.handle(run("b"))
    loop.turn(0.0)
    binding.batch.fail.add("a")
    settle(loop, clock)
    msgs = messages(engine)
    assert failures(msgs) == {"a": "RuntimeError: boom"} and set(dones(msgs)) == {"b"}
    assert text_of(msgs, "a") == "one"  # what it had made went out before its failure
    chunk_at = max(i for i, m in enumerate(msgs) if isinstance(m, Chunks) and text_of([m], "a"))
    assert chunk_at < next(i for i, m in enumerate(msgs) if isinstance(m, Failure))


def test_a_request_the_batch_refuses_fails_alone(worker) -> None:
    loop, engine, _binding, clock = worker
    loop.handle(run("a"))
    loop.handle(run("long", prompt=tuple(range(100))))  # past the fake's 64-token cache
    settle(loop, clock)
    msgs = messages(engine)
    assert list(failures(msgs)) == ["long"] and "KV cache" in failures(msgs)["long"]
    assert dones(msgs)["a"].finish_reason is FinishReason.LENGTH


def test_a_batch_that_raised_fails_its_requests_and_the_next_request_gets_a_new_one(worker) -> None:
    loop, engine, binding, clock = worker
    loop.handle(run("a"))
    loop.turn(0.0)
    broken = binding.batch
    broken.broken = RuntimeError("the library fell over")
    loop.turn(0.0)
    assert failures(messages(engine)) == {"a": "RuntimeError: the library fell over"}
    loop.handle(run("b"))
    settle(loop, clock)
    assert broken.closed and binding.batch is not broken and binding.batch.added == ["b"]
    assert dones(messages(engine))["b"].finish_reason is FinishReason.LENGTH


def test_a_batch_that_cannot_be_made_anew_fails_the_waiting_requests_and_the_next_ones_try_again(worker) -> None:
    loop, engine, binding, clock = worker
    binding.batch.alive = False
    make = binding.make

    def refuse() -> FakeBatch:
        raise RuntimeError("out of memory")

    binding.make = refuse
    loop.handle(run("a"))
    loop.turn(0.0)
    assert failures(messages(engine)) == {"a": "RuntimeError: out of memory"}
    binding.make = make
    loop.handle(run("b"))
    settle(loop, clock)
    assert dones(messages(engine))["b"].finish_reason is FinishReason.LENGTH


def test_text_that_cannot_be_decoded_fails_the_running_requests_not_the_worker(worker) -> None:
    loop, engine, _, _ = worker
    loop.handle(run("a"))
    assert loop.text is not None

    def broken(seqs: object) -> list[str]:
        raise UnicodeError("bad bytes")

    loop.text.decode_many = broken
    loop.turn(0.0)
    assert failures(messages(engine)) == {"a": "UnicodeError: bad bytes"} and not loop.live


def test_a_batch_whose_thread_died_is_made_anew_for_the_next_request(worker) -> None:
    loop, engine, binding, clock = worker
    dead = binding.batch
    dead.alive = False
    loop.handle(run("a"))
    settle(loop, clock)
    assert dead.closed and dead.added == [] and binding.batch.added == ["a"]
    assert binding.batch.threads == 4
    assert dones(messages(engine))["a"].finish_reason is FinishReason.LENGTH


def test_a_load_replaces_the_model_and_fails_what_the_old_one_held(worker, tmp_path: Path) -> None:
    loop, engine, binding, clock = worker
    old = binding.batch
    loop.handle(run("a"))
    loop.turn(0.0)
    loop.handle(run("queued"))
    loop.handle(load(tmp_path))
    msgs = messages(engine)
    assert failures(msgs) == {
        "a": "the worker was bound to another model",
        "queued": "the worker was bound to another model",
    }
    assert isinstance(msgs[-1], Loaded)
    assert old.closed and binding.released == 2 and binding.batch is not old
    loop.handle(run("b"))
    settle(loop, clock)
    assert binding.batch.added == ["b"] and dones(messages(engine))["b"].completion_tokens == 4


def test_a_refused_load_leaves_the_bound_model_serving(worker, tmp_path: Path) -> None:
    loop, engine, binding, clock = worker
    loop.handle(run("a"))
    loop.turn(0.0)
    binding.refuse = FileNotFoundError("no torch checkpoint")
    loop.handle(load(tmp_path))
    assert failures(messages(engine)) == {None: "FileNotFoundError: no torch checkpoint"}
    settle(loop, clock)
    assert dones(messages(engine))["a"].finish_reason is FinishReason.LENGTH


def test_a_request_with_no_model_loaded_fails(tmp_path: Path) -> None:
    engine, worker_end = multiprocessing.Pipe()
    loop = WorkerLoop(worker_end, FakeBinding(), threads=1)
    loop.handle(run("a"))
    loop.turn(0.0)
    assert failures(messages(engine)) == {"a": "no model loaded in this worker"}


def test_a_tier_up_is_answered_now_or_when_the_binding_s_build_ends(worker) -> None:
    loop, engine, binding, _ = worker
    loop.handle(TierUpNow())
    assert messages(engine) == [TieredUp(Tier.TORCH, 0.0, "")]
    binding.built = TieredUp(Tier.STEADY, 2.5, "")  # a tier built in the background
    loop.turn(0.0)
    assert messages(engine) == [TieredUp(Tier.STEADY, 2.5, "")]


def test_a_session_drop_goes_to_the_binding_and_a_command_that_raises_is_answered(worker) -> None:
    loop, engine, binding, _ = worker
    loop.handle(DropSession("s1"))
    assert binding.dropped == ["s1"]

    def boom(session: str) -> None:
        raise RuntimeError("cannot drop")

    binding.drop_session = boom  # type: ignore[method-assign]
    loop.handle(DropSession("s2"))
    assert failures(messages(engine)) == {None: "RuntimeError: cannot drop"}


def test_the_loop_serves_until_its_pipe_closes_and_closes_what_it_holds(worker) -> None:
    loop, engine, binding, _ = worker
    engine.send(run("a"))
    engine.send(CancelRun("a"))
    engine.close()  # the engine's end: the loop reads what was sent, then ends
    loop.serve()
    assert binding.batch.closed and binding.closed


def test_a_start_runs_on_its_core_share_until_tiered_up(tmp_path: Path) -> None:
    """`Load.cores`: the load and the first steps run on that many threads, pinned to those
    cores; a tier-up (the node is idle) gives every core back."""
    import os

    from services.engine.cpu_share import pin_all_threads

    _engine, worker_end = multiprocessing.Pipe()
    binding, threads = FakeBinding(), list[int]()
    loop = WorkerLoop(worker_end, binding, threads=4, set_threads=threads.append)
    all_cores = loop.all_cores
    one = min(all_cores)
    try:
        loop.handle(Load(Artifact("a", str(tmp_path), "s", 2048, 1, 1), cores=(one,)))
        assert os.sched_getaffinity(0) == {one} and binding.loads[0][1] == 1 and threads == [1]
        assert binding.batch.threads == 1
        loop.handle(TierUpNow())
        assert os.sched_getaffinity(0) == all_cores and threads == [1, 4] and binding.batch.threads == 4
    finally:
        pin_all_threads(all_cores)

"""The torch worker's side of the worker protocol (`worker_wire`), over a real pipe, with a
stand-in batch (`FakeBatch`: no model; the real one, `ContinuousBatcher`, runs the real model in
tests/e2e/test_torch_engine.py): requests stream their text and end with a `Done` whose counts
are the tokens they generated; requests that arrive while others run join them; a cancel ends
a running request at its next step and stops its computation; a stop string does too; a
failed request fails alone; a tier-up is answered (there is no other tier); a structured-output
request runs with its guide, and one whose guide does not compile fails alone."""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable, Iterator, Sequence
from multiprocessing.connection import Connection

import pytest

pytest.importorskip("torch", reason="the torch engine needs torch")

from cuda_ext import TensorArena
from services.engine.batch_types import Step
from services.engine.cpu_share import pin_all_threads
from services.engine.torch_engine.guides import GuideError
from services.engine.torch_engine.worker import TorchWorker
from services.engine.worker_wire import CancelRun, Chunks, Done, Failure, Run, Started, TieredUp, TierUpNow
from shared.artifact import TORCH_MANIFEST, torch_checkpoint
from shared.messages import FinishReason, Guide, SamplingParams, Tier

WORDS = {1: "one", 2: " two", 3: " three", 4: " four"}


class Tokenizer:
    def decode(self, ids: Sequence[int], **_: object) -> str:
        return "".join(WORDS[i] for i in ids)


class Engine:
    tokenizer = Tokenizer()


class FakeBatch:
    """Stands in for `ContinuousBatcher`: each look steps every request once, giving it the
    next of 1, 2, 3, 4 (up to max_tokens), then its end of sequence."""

    def __init__(self) -> None:
        self.requests: dict[str, tuple[SamplingParams, int]] = {}
        self.cancelled: list[str] = []
        self.fail: set[str] = set()
        self.refuse = False
        """`add` raises as the real batch does for a guide that does not compile."""
        self.waited = 0.0

    @property
    def active(self) -> int:
        return len(self.requests)

    alive = True
    threads = 0

    def set_threads(self, threads: int) -> None:
        self.threads = threads

    kv_bytes = 4096

    def device_bytes(self) -> int:
        return 1 << 20

    def add(
        self, request_id: str, prompt_ids: Sequence[int], params: SamplingParams, deadline: Callable[[int], float]
    ) -> None:
        if self.refuse:
            raise GuideError("regex: unclosed character class")
        self.requests[request_id] = (params, 0)

    def cancel(self, request_id: str) -> None:
        self.cancelled.append(request_id)
        self.requests.pop(request_id, None)

    def steps(self, timeout: float) -> list[Step]:
        out = []
        for rid, (params, made) in list(self.requests.items()):
            if rid in self.fail:
                del self.requests[rid]
                out.append(Step(rid, (), None, "RuntimeError: boom"))
                continue
            if made == len(WORDS):
                del self.requests[rid]
                out.append(Step(rid, (), FinishReason.STOP))
                continue
            made += 1
            self.requests[rid] = (params, made)
            finish = FinishReason.LENGTH if made == params.max_tokens else None
            if finish is not None:
                del self.requests[rid]
            out.append(Step(rid, ((made, None),), finish))
        return out

    def close(self) -> None:
        self.requests.clear()


def run(request_id: str, max_tokens: int = 4, **params: object) -> Run:
    return Run(request_id, "m", (7, 8, 9), SamplingParams(max_tokens=max_tokens, temperature=0.0, **params), 0.0)  # type: ignore[arg-type]


def messages(engine: Connection) -> list[object]:
    out = []
    while engine.poll(0):
        out.append(engine.recv())
    return out


def text_of(msgs: list[object], request_id: str) -> str:
    return "".join(c.text for m in msgs if isinstance(m, Chunks) for c in m.items if c.request_id == request_id)


def dones(msgs: list[object]) -> dict[str, Done]:
    return {m.request_id: m for m in msgs if isinstance(m, Done)}


def drain(w: TorchWorker) -> None:
    for _ in range(10):
        if not w.live:
            return
        w.pump(0.0)
    raise AssertionError("requests never ended")


@pytest.fixture
def worker() -> Iterator[tuple[TorchWorker, Connection, FakeBatch]]:
    engine_end, worker_end = multiprocessing.Pipe()
    w = TorchWorker(worker_end, TensorArena(1 << 20, device="cpu"))
    batch = FakeBatch()
    w.engine = Engine()  # type: ignore[assignment]
    w.tokenizer = w.engine.tokenizer
    w.batch = batch
    yield w, engine_end, batch
    engine_end.close()
    worker_end.close()


def test_a_request_streams_its_text_and_ends_with_honest_counts(worker) -> None:
    w, engine, _ = worker
    w._handle(run("a"))
    drain(w)
    msgs = messages(engine)
    assert msgs[0] == Started("a", 1)
    assert text_of(msgs, "a") == "one two three four"
    assert sum(c.tokens for m in msgs if isinstance(m, Chunks) for c in m.items) == 4
    done = msgs[-1]
    assert isinstance(done, Done)
    assert (done.finish_reason, done.completion_tokens, done.prompt_tokens) == (FinishReason.LENGTH, 4, 3)
    assert done.first_token_at is not None and done.batch == 1
    # What its batch holds, for the node's true-up of its memory.
    assert (done.kv_allocated_bytes, done.device_bytes) == (4096, 1 << 20)


def test_an_end_of_sequence_before_max_tokens_is_a_stop(worker) -> None:
    w, engine, _ = worker
    w._handle(run("a", max_tokens=9))  # the stand-in ends after four tokens
    drain(w)
    done = messages(engine)[-1]
    assert isinstance(done, Done) and (done.finish_reason, done.completion_tokens) == (FinishReason.STOP, 4)


def test_requests_that_arrive_while_others_run_join_the_batch(worker) -> None:
    w, engine, _ = worker
    w._handle(run("a"))
    w.pump(0.0)  # a has its first token
    w._handle(run("b", max_tokens=2))
    w.pump(0.0)  # one step: a's second token and b's first travel in one message
    msgs = messages(engine)
    both = [m for m in msgs if isinstance(m, Chunks) and {c.request_id for c in m.items} == {"a", "b"}]
    assert len(both) == 1
    drain(w)
    msgs += messages(engine)
    assert text_of(msgs, "a") == "one two three four" and text_of(msgs, "b") == "one two"
    done = dones(msgs)
    assert done["a"].batch == 2 and done["b"].batch == 2
    assert (done["b"].finish_reason, done["b"].completion_tokens) == (FinishReason.LENGTH, 2)


def test_a_stop_string_ends_the_request_and_its_computation(worker) -> None:
    w, engine, batch = worker
    w._handle(run("a", stop=(" three",)))
    drain(w)
    msgs = messages(engine)
    assert text_of(msgs, "a") == "one two"
    done = msgs[-1]
    assert isinstance(done, Done) and (done.finish_reason, done.completion_tokens) == (FinishReason.STOP, 3)
    assert batch.cancelled == ["a"] and not batch.requests


def test_a_cancel_ends_the_running_request_and_its_computation_not_its_neighbours(worker) -> None:
    w, engine, batch = worker
    w._handle(run("a"))
    w._handle(run("b"))
    w.pump(0.0)
    engine.send(CancelRun("a"))  # read by the worker between looks at the batch
    w._read_commands()
    drain(w)
    msgs = messages(engine)
    done = dones(msgs)
    assert (done["a"].finish_reason, done["a"].completion_tokens) == (FinishReason.CANCELLED, 1)
    assert batch.cancelled == ["a"]
    assert text_of(msgs, "b") == "one two three four" and done["b"].finish_reason is FinishReason.LENGTH


def test_a_failed_request_fails_alone(worker) -> None:
    w, engine, batch = worker
    w._handle(run("a"))
    w._handle(run("b"))
    batch.fail.add("a")
    drain(w)
    msgs = messages(engine)
    failures = [m for m in msgs if isinstance(m, Failure)]
    assert [f.request_id for f in failures] == ["a"] and "boom" in failures[0].message
    assert set(dones(msgs)) == {"b"}


def test_a_structured_output_request_runs_with_its_guide_and_one_that_does_not_compile_fails_alone(worker) -> None:
    w, engine, batch = worker
    guide = Guide(kind="regex", spec="[0-9]+")
    w._handle(run("a", guide=guide))
    assert batch.requests["a"][0].guide == guide  # the batch enforces it (tests/e2e/test_torch_engine.py)
    batch.refuse = True
    w._handle(run("b", guide=Guide(kind="regex", spec="[0-9")))
    msgs = messages(engine)
    failures = [m for m in msgs if isinstance(m, Failure)]
    assert [f.request_id for f in failures] == ["b"] and "unclosed" in failures[0].message
    assert "b" not in w.live and "a" in w.live


def test_a_tier_up_is_answered_on_the_one_tier(worker) -> None:
    w, engine, _ = worker
    w._handle(TierUpNow())
    assert messages(engine) == [TieredUp(Tier.TORCH, 0.0, "")]


def test_a_request_with_no_model_loaded_fails(worker) -> None:
    w, engine, _ = worker
    w.tokenizer, w.batch = None, None
    w._handle(run("a"))
    msgs = messages(engine)
    assert len(msgs) == 1 and isinstance(msgs[0], Failure) and msgs[0].request_id == "a"


def test_a_start_runs_on_its_core_share_until_the_idle_node_gives_every_core_back(
    worker, monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:
    """`Load.cores`: the load and the first steps run on that many threads, every thread of
    the worker pinned to those cores; `TierUpNow` (the node is idle) gives them all back."""
    import torch

    import services.engine.torch_engine.worker as worker_module
    from services.engine.worker_wire import Load, Loaded
    from shared.messages import Artifact

    w, engine, _ = worker
    w.tokenizer, w.batch = None, None  # a pre-warmed worker, bound to no model
    seen: dict[str, object] = {}

    class Started:
        tokenizer = Tokenizer()
        loaded = type("Loaded", (), {"reused_bytes": 0})()

        @staticmethod
        def start(checkpoint: object, arena: object, placement: object, fill: object) -> Started:
            seen["threads"], seen["cores"] = torch.get_num_threads(), os.sched_getaffinity(0)
            return Started()

    monkeypatch.setattr(worker_module, "TorchEngine", Started)
    monkeypatch.setattr(worker_module, "ContinuousBatcher", lambda *_: FakeBatch())
    artifact = Artifact("a", str(tmp_path), "s", 2048, 1, 1)
    torch_checkpoint(artifact).mkdir()
    (torch_checkpoint(artifact) / TORCH_MANIFEST).write_text("{}")  # what the worker checks is there
    all_cores, threads = w.all_cores, w.threads
    one = min(all_cores)
    try:
        w._handle(Load(artifact, cores=(one,)))
        (loaded,) = messages(engine)
        assert isinstance(loaded, Loaded) and loaded.threads == 1
        assert seen == {"threads": 1, "cores": {one}}
        assert w.batch is not None and w.batch.threads == 1  # type: ignore[attr-defined]  (its own thread's count)
        w._handle(TierUpNow())
        assert messages(engine) == [TieredUp(Tier.TORCH, 0.0, "")]
        assert os.sched_getaffinity(0) == all_cores and torch.get_num_threads() == threads
        assert w.batch.threads == threads  # type: ignore[attr-defined]
    finally:
        pin_all_threads(all_cores)
        torch.set_num_threads(threads)


def test_a_batch_whose_thread_died_is_made_anew_for_the_next_request(worker, monkeypatch: pytest.MonkeyPatch) -> None:
    """An error inside the library ends its thread and the requests on it; the next request
    gets a new batch rather than a worker that fails everything until its next load."""
    import services.engine.torch_engine.worker as worker_module

    w, engine, dead = worker
    dead.alive = False
    fresh = FakeBatch()
    monkeypatch.setattr(worker_module, "ContinuousBatcher", lambda *_: fresh)
    w._handle(run("a"))
    assert w.batch is fresh and "a" in fresh.requests and not dead.requests
    assert fresh.threads == w.threads
    drain(w)
    assert dones(messages(engine))["a"].finish_reason is FinishReason.LENGTH

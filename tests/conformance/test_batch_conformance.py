"""Every engine's `Batch` (`services/engine/batch_types.py`) driven through the one worker loop
and its text (`worker_loop.py`, `text.py`), over a real pipe, as a worker process drives it:
the seams between a library's tokens and the text a client gets. Each case runs on every
batch whose library imports here (`SUBJECTS`); one whose library is missing is skipped.

- a cancel ends the request, its text and its computation, at once;
- a stop string whose characters come from two steps ends the text before it, at the token
  that completes it, and the batch stops computing the request;
- an end of sequence ends a request before max_tokens ("stop"), max_tokens on "length";
- a request the batch refuses (longer than its KV cache) fails alone, its neighbour finishes;
- the streamed text is the library's own detokenization of the ids generated, whole
  characters split over tokens included.

To add an engine, add a factory to `SUBJECTS`: a context manager that yields a `Subject`.
"""

from __future__ import annotations

import math
import multiprocessing
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import pytest

from services.engine.batch_types import Batch, Step
from services.engine.text import DecodeMany, batch_decoder
from services.engine.worker_loop import Bound, WorkerLoop
from services.engine.worker_wire import CancelRun, Chunks, Done, Failure, Load, Loaded, Run, TieredUp
from shared.messages import Artifact, FinishReason, Guide, SamplingParams, Tier
from tests.helpers import fake_batch


@dataclass
class Subject:
    """One engine's batch and what the cases need to know of its library."""

    batch: Batch
    decode_many: DecodeMany
    decode: Callable[[Sequence[int]], str]
    """The library's own detokenization of a completion's ids (what a client of it reads)."""
    prompt: tuple[int, ...]
    kv_tokens: int
    """Its KV cache: a longer request is refused."""
    plain: dict[str, Any] = field(default_factory=dict)
    """Sampling parameters under which its text is plain characters, one or more a token
    (a grammar, for a model of random weights)."""
    ends: dict[str, Any] = field(default_factory=dict)
    """Sampling parameters under which it ends by itself (an end of sequence) within 32 tokens."""


@contextmanager
def fake(tmp: Path) -> Iterator[Subject]:
    batch = fake_batch.FakeBatch()
    yield Subject(batch, fake_batch.decode_many, fake_batch.decode, (1, 2, 3), batch.kv_tokens)
    batch.close()


@contextmanager
def torch_batch(tmp: Path) -> Iterator[Subject]:
    pytest.importorskip("torch", reason="the torch engine needs torch")
    from cuda_ext import TensorArena
    from services.engine.torch_engine.batching import ContinuousBatcher
    from services.engine.torch_engine.engine import TorchEngine
    from tests.unit.test_torch_batch_tiny import tiny_checkpoint

    engine = TorchEngine.start(tiny_checkpoint(tmp), TensorArena(64 << 20, device="cpu"))
    batch = ContinuousBatcher(engine, max_batch=8, kv_tokens=256)
    tokenizer = engine.tokenizer
    try:
        yield Subject(
            batch,
            batch_decoder(tokenizer),
            lambda ids: str(tokenizer.decode(list(ids), skip_special_tokens=True)),
            tuple(tokenizer("hello there", add_special_tokens=False)["input_ids"]),
            batch.kv_tokens,
            # A random model's bytes are mostly not text: a grammar makes them letters.
            plain={"guide": Guide(kind="regex", spec="[a-z]{40}")},
            ends={"guide": Guide(kind="regex", spec="[a-z]{5}")},
        )
    finally:
        batch.close()
        engine.close()


@contextmanager
def vllm_batch(tmp: Path) -> Iterator[Subject]:
    pytest.importorskip("vllm", reason="vLLM is not installed here")
    from services.engine.vllm_engine.batch import VllmBatch
    from tests.unit.test_torch_batch_tiny import tiny_checkpoint

    batch = VllmBatch(tiny_checkpoint(tmp), max_batch=8, kv_tokens=256)
    tokenizer = batch.tokenizer
    try:
        yield Subject(
            batch,
            batch_decoder(tokenizer),
            lambda ids: str(tokenizer.decode(list(ids), skip_special_tokens=True)),
            tuple(tokenizer("hello there", add_special_tokens=False)["input_ids"]),
            batch.max_len,
            plain={"guide": Guide(kind="regex", spec="[a-z]{40}")},
            ends={"guide": Guide(kind="regex", spec="[a-z]{5}")},
        )
    finally:
        batch.close()


def _openvino(make: str) -> Callable[[Path], AbstractContextManager[Subject]]:
    """An OpenVINO batch on the default model (`ovbatches.py`: the start tier, the core, or the
    worker's batch over both)."""

    @contextmanager
    def subject(tmp: Path) -> Iterator[Subject]:
        from tests.conformance import ovbatches

        batch, decode_many = getattr(ovbatches, make)()
        try:
            yield Subject(
                batch,
                decode_many,
                ovbatches.decode,
                tuple(ovbatches.encode("Hello there")),
                ovbatches.kv_tokens(),
                ends={"prompt": tuple(ovbatches.encode(ovbatches.PROMPT))},
            )
        finally:
            batch.close()

    return subject


SUBJECTS: dict[str, Callable[[Path], AbstractContextManager[Subject]]] = {
    "fake": fake,
    "torch": torch_batch,
    "vllm": vllm_batch,
    "openvino-start": _openvino("start_batch_factory"),
    "openvino-core": _openvino("core_batch_factory"),
    "openvino-tiered": _openvino("tiered_batch_factory"),
}
"""Every engine's batch, by name: a factory given a scratch directory."""


class Recorded:
    """The subject's batch, seen through: the ids each request got (what the library's own
    detokenization is compared with) and whether it still computes it."""

    def __init__(self, batch: Batch) -> None:
        self._batch = batch
        self.ids: dict[str, list[int]] = {}
        self.holding: set[str] = set()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._batch, name)

    def add(
        self, request_id: str, prompt_ids: Sequence[int], params: SamplingParams, deadline: Any, kv_tokens: int = 0
    ) -> None:
        self._batch.add(request_id, prompt_ids, params, deadline, kv_tokens)
        self.ids[request_id] = []
        self.holding.add(request_id)

    def cancel(self, request_id: str) -> None:
        self._batch.cancel(request_id)
        self.holding.discard(request_id)

    def steps(self, timeout: float) -> list[Step]:
        steps = self._batch.steps(timeout)
        for step in steps:
            self.ids.setdefault(step.request_id, []).extend(t for t, _ in step.tokens)
            if step.finish is not None or step.error:
                self.holding.discard(step.request_id)
        return steps


class Given:
    """A binding that binds the subject's batch (the loop's side of a `Load`)."""

    wake_s: float | None = None
    build_window = (math.inf, math.inf)

    def __init__(self, batch: Recorded, decode_many: DecodeMany) -> None:
        self.batch, self.decode_many = batch, decode_many

    def load_beside(self, load: Load) -> Loaded | None:
        return None

    def load(self, load: Load, threads: int) -> Bound:
        return Bound(Loaded(loaded_from_cache=True, load_s=0.0, threads=threads), self.batch, self.decode_many)  # type: ignore[arg-type]

    def reopen(self, threads: int) -> Batch:
        raise AssertionError("the subject's batch died")

    def release(self) -> None:
        pass

    def tier_up(self) -> TieredUp:
        return TieredUp(Tier.TORCH, 0.0, "")

    def tiered(self) -> None:
        return None

    def drop_session(self, session: str) -> None:
        pass

    def close(self) -> None:
        pass


@dataclass
class Worker:
    loop: WorkerLoop
    engine: Connection
    batch: Recorded
    subject: Subject
    seen: list[object] = field(default_factory=list)

    def run(self, request_id: str, prompt: Sequence[int] | None = None, **params: Any) -> None:
        sampling = SamplingParams(temperature=0.0, **params)
        prompt = tuple(prompt if prompt is not None else self.subject.prompt)
        self.loop.handle(Run(request_id, "s", prompt, sampling, 0.0))

    def turn(self) -> list[object]:
        self.loop.turn(0.05)
        new = []
        while self.engine.poll(0):
            new.append(self.engine.recv())
        self.seen += new
        return new

    def until_ended(self, *request_ids: str) -> None:
        for _ in range(20_000):  # a bound on looks at the batch, not on time
            if all(rid in self.ended() for rid in request_ids):
                return
            self.turn()
        raise AssertionError(f"never ended: {request_ids}")

    def ended(self) -> dict[str, Done | Failure]:
        return {m.request_id: m for m in self.seen if isinstance(m, Done | Failure) and m.request_id is not None}

    def text(self, request_id: str) -> str:
        return "".join(
            c.text for m in self.seen if isinstance(m, Chunks) for c in m.items if c.request_id == request_id
        )


@pytest.fixture(params=list(SUBJECTS))
def worker(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Worker]:
    with SUBJECTS[request.param](tmp_path) as subject:
        engine_end, worker_end = multiprocessing.Pipe()
        batch = Recorded(subject.batch)
        loop = WorkerLoop(worker_end, Given(batch, subject.decode_many), threads=1)
        loop.handle(Load(Artifact("a", str(tmp_path), "s", 2048, 1, 1), cores=None))
        assert isinstance(engine_end.recv(), Loaded)
        try:
            yield Worker(loop, engine_end, batch, subject)
        finally:
            engine_end.close()
            worker_end.close()


def done(w: Worker, request_id: str) -> Done:
    end = w.ended()[request_id]
    assert isinstance(end, Done), end
    return end


def test_a_cancel_ends_the_request_its_text_and_its_computation(worker: Worker) -> None:
    w = worker
    many = w.subject.kv_tokens // 2
    w.run("c", max_tokens=many, ignore_eos=True)
    while not w.text("c") and "c" not in w.ended():
        w.turn()
    w.loop.handle(CancelRun("c"))
    w.turn()
    end = done(w, "c")
    assert end.finish_reason is FinishReason.CANCELLED and 0 < end.completion_tokens < many
    assert "c" not in w.batch.holding  # the batch was told to stop it
    after = len(w.seen)
    w.run("n", max_tokens=3, ignore_eos=True)
    w.until_ended("n")
    assert not [m for m in w.seen[after:] if isinstance(m, Chunks) and any(c.request_id == "c" for c in m.items)]


def test_a_stop_string_split_across_steps_ends_the_text_before_it(worker: Worker) -> None:
    w = worker
    w.run("whole", max_tokens=24, ignore_eos=True, **w.subject.plain)
    w.until_ended("whole")
    ids = w.batch.ids["whole"]
    full = w.subject.decode(ids)
    # A stop made of the last character of one token's text and the first of the next's,
    # found nowhere earlier in the text.
    for k in range(1, len(ids) - 1):
        head, more = w.subject.decode(ids[:k]), w.subject.decode(ids[: k + 1])
        if not head or len(more) == len(head) or "\ufffd" in more or not full.startswith(more):
            continue
        stop = head[-1] + more[len(head)]
        if full.find(stop) == len(head) - 1:
            break
    else:
        pytest.fail(f"no token boundary in {full!r} to split a stop string over")
    w.run("stopped", max_tokens=24, ignore_eos=True, stop=(stop,), **w.subject.plain)
    w.until_ended("stopped")
    end = done(w, "stopped")
    assert w.text("stopped") == full[: len(head) - 1]
    assert end.finish_reason is FinishReason.STOP and end.completion_tokens == k + 1
    assert "stopped" not in w.batch.holding


def test_an_end_of_sequence_is_a_stop_and_max_tokens_a_length(worker: Worker) -> None:
    w = worker
    w.run("eos", max_tokens=32, **w.subject.ends)
    w.run("length", max_tokens=3, ignore_eos=True, **w.subject.plain)
    w.until_ended("eos", "length")
    eos, length = done(w, "eos"), done(w, "length")
    assert eos.finish_reason is FinishReason.STOP and 0 < eos.completion_tokens < 32
    assert eos.completion_tokens == len(w.batch.ids["eos"])  # the end of sequence is no token of it
    assert w.text("eos") == w.subject.decode(w.batch.ids["eos"])
    assert (length.finish_reason, length.completion_tokens) == (FinishReason.LENGTH, 3)


def test_a_request_the_batch_refuses_fails_alone(worker: Worker) -> None:
    w = worker
    w.run("good", max_tokens=4, ignore_eos=True)
    w.run("long", prompt=[w.subject.prompt[0]] * (w.subject.kv_tokens + 1), max_tokens=4)
    w.until_ended("good", "long")
    assert isinstance(w.ended()["long"], Failure) and "KV cache" in w.ended()["long"].message  # type: ignore[union-attr]
    assert (done(w, "good").finish_reason, done(w, "good").completion_tokens) == (FinishReason.LENGTH, 4)


def test_the_text_is_the_library_s_own_detokenization_of_the_ids(worker: Worker) -> None:
    w = worker
    # Unconstrained: a random model's bytes split characters over tokens, and some are no
    # text at all; the stream must still add up to what the library decodes.
    w.run("raw", max_tokens=32, ignore_eos=True)
    w.run("plain", max_tokens=16, ignore_eos=True, **w.subject.plain)
    w.until_ended("raw", "plain")
    for rid in ("raw", "plain"):
        ids = w.batch.ids[rid]
        assert w.text(rid) == w.subject.decode(ids), rid
        assert done(w, rid).completion_tokens == len(ids)
        chunks = [c for m in w.seen if isinstance(m, Chunks) for c in m.items if c.request_id == rid]
        assert sum(c.tokens for c in chunks) == len(ids)

"""The torch worker's side of the worker protocol (`worker_wire`), over a real pipe, with a
stand-in engine (no model): a request streams its text and ends with a `Done` whose counts are
the tokens it generated; a cancel ends the running request after its current token and a
queued one at once; a tier-up is answered (there is no other tier); a structured-output
request is refused, never run without its grammar."""

from __future__ import annotations

import multiprocessing
from collections.abc import Generator, Iterator, Sequence
from multiprocessing.connection import Connection

import pytest

pytest.importorskip("torch", reason="the torch engine needs torch")

from cuda_ext import TensorArena
from services.engine.torch_engine.worker import TorchWorker
from services.engine.worker_wire import CancelRun, Chunks, Done, Failure, Run, Started, TieredUp, TierUpNow
from shared.messages import FinishReason, Guide, SamplingParams, Tier, TokenLogprob

WORDS = {1: "one", 2: " two", 3: " three", 4: " four"}


class Tokenizer:
    def decode(self, ids: Sequence[int], **_: object) -> str:
        return "".join(WORDS[i] for i in ids)


class Engine:
    """Stands in for `TorchEngine`: yields 1, 2, 3, 4 (up to max_tokens), then its end of sequence."""

    tokenizer = Tokenizer()

    def __init__(self) -> None:
        self.closed_steps = 0

    def steps(self, prompt_ids: Sequence[int], params: SamplingParams) -> Generator[tuple[int, TokenLogprob | None]]:
        try:
            for token in list(WORDS)[: params.max_tokens]:
                yield token, None
        finally:
            self.closed_steps += 1


def run(request_id: str, max_tokens: int = 4, **params: object) -> Run:
    return Run(request_id, "m", (7, 8, 9), SamplingParams(max_tokens=max_tokens, temperature=0.0, **params), 0.0)  # type: ignore[arg-type]


def messages(engine: Connection) -> list[object]:
    out = []
    while engine.poll(0):
        out.append(engine.recv())
    return out


def text_of(msgs: list[object], request_id: str) -> str:
    return "".join(c.text for m in msgs if isinstance(m, Chunks) for c in m.items if c.request_id == request_id)


@pytest.fixture
def worker() -> Iterator[tuple[TorchWorker, Connection]]:
    engine_end, worker_end = multiprocessing.Pipe()
    w = TorchWorker(worker_end, TensorArena(1 << 20, device="cpu"))
    w.engine = Engine()  # type: ignore[assignment]
    yield w, engine_end
    engine_end.close()
    worker_end.close()


def test_a_request_streams_its_text_and_ends_with_honest_counts(worker) -> None:
    w, engine = worker
    w._handle(run("a"))
    w._run(w.queue.popleft())
    msgs = messages(engine)
    assert msgs[0] == Started("a", 1)
    assert text_of(msgs, "a") == "one two three four"
    assert sum(c.tokens for m in msgs if isinstance(m, Chunks) for c in m.items) == 4
    done = msgs[-1]
    assert isinstance(done, Done)
    assert (done.finish_reason, done.completion_tokens, done.prompt_tokens) == (FinishReason.LENGTH, 4, 3)
    assert done.first_token_at is not None and done.batch == 1


def test_an_end_of_sequence_before_max_tokens_is_a_stop(worker) -> None:
    w, engine = worker
    w._handle(run("a", max_tokens=9))  # the stand-in ends after four tokens
    w._run(w.queue.popleft())
    done = messages(engine)[-1]
    assert isinstance(done, Done) and (done.finish_reason, done.completion_tokens) == (FinishReason.STOP, 4)


def test_a_stop_string_ends_the_request_and_its_computation(worker) -> None:
    w, engine = worker
    fake = w.engine
    w._handle(run("a", stop=(" three",)))
    w._run(w.queue.popleft())
    msgs = messages(engine)
    assert text_of(msgs, "a") == "one two"
    done = msgs[-1]
    assert isinstance(done, Done) and (done.finish_reason, done.completion_tokens) == (FinishReason.STOP, 3)
    assert fake.closed_steps == 1  # type: ignore[union-attr]


def test_a_cancel_ends_the_running_request_after_its_current_token(worker) -> None:
    w, engine = worker
    fake = w.engine
    w._handle(run("a"))
    engine.send(CancelRun("a"))  # read by the worker between tokens
    w._run(w.queue.popleft())
    msgs = messages(engine)
    done = msgs[-1]
    assert isinstance(done, Done) and (done.finish_reason, done.completion_tokens) == (FinishReason.CANCELLED, 1)
    assert fake.closed_steps == 1  # type: ignore[union-attr]


def test_a_cancelled_queued_request_ends_at_once_and_a_later_one_still_runs(worker) -> None:
    w, engine = worker
    w._handle(run("a"))
    w._handle(run("b", max_tokens=2))
    w._handle(CancelRun("a"))
    assert messages(engine) == [Done("a", FinishReason.CANCELLED, 0, None, 3)]
    w._run(w.queue.popleft())
    msgs = messages(engine)
    assert text_of(msgs, "b") == "one two" and not w.queue


def test_a_request_that_arrives_while_another_runs_waits_in_line(worker) -> None:
    w, engine = worker
    w._handle(run("a"))
    engine.send(run("b"))
    w._run(w.queue.popleft())
    assert [r.request_id for r in w.queue] == ["b"]


def test_a_structured_output_request_is_refused_not_run_without_its_grammar(worker) -> None:
    w, engine = worker
    w._handle(run("a", guide=Guide(kind="regex", spec="[0-9]+")))
    msgs = messages(engine)
    assert len(msgs) == 1 and isinstance(msgs[0], Failure) and msgs[0].request_id == "a"
    assert not w.queue


def test_a_tier_up_is_answered_on_the_one_tier(worker) -> None:
    w, engine = worker
    w._handle(TierUpNow())
    assert messages(engine) == [TieredUp(Tier.STEADY, 0.0, "")]


def test_a_request_with_no_model_loaded_fails(worker) -> None:
    w, engine = worker
    w.engine = None
    w._run(run("a"))
    msgs = messages(engine)
    assert len(msgs) == 1 and isinstance(msgs[0], Failure) and msgs[0].request_id == "a"

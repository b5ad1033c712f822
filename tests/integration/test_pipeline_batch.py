"""The batch a pipelined instance serves with (services/engine/torch_engine/stage_wire.py):
real stage servers over TCP, each running a stand-in stage whose logits favour a known token,
so that what the driver picks, streams and ends is known exactly."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator

import pytest

pytest.importorskip("torch", reason="the torch engine needs torch")

import torch

from services.engine.batch_types import Step
from services.engine.torch_engine.stage_wire import PipelineBatch, StageServer
from shared.messages import FinishReason, Guide, SamplingParams
from tests.helpers.cluster import wait_for

VOCAB = 16
EOS = 15


class Adds:
    """A middle stage: hidden states in, one more out (it proves its pass ran)."""

    def __init__(self) -> None:
        self.sessions: set[str] = set()

    def forward(self, session: str, x: torch.Tensor) -> torch.Tensor:
        self.sessions.add(session)
        return x.float().unsqueeze(-1) + 1.0 if x.dim() == 2 else x + 1.0

    def drop(self, session: str) -> None:
        self.sessions.discard(session)


class Head:
    """The last stage: logits that favour the value it is handed (the last id + 1, by `Adds`):
    greedy decoding counts up from the prompt's last id."""

    def __init__(self) -> None:
        self.sessions: set[str] = set()

    def forward(self, session: str, x: torch.Tensor) -> torch.Tensor:
        self.sessions.add(session)
        nxt = int(x[0, -1, 0].item())
        logits = torch.zeros(VOCAB)
        logits[min(nxt, VOCAB - 1)] = 10.0
        return logits

    def drop(self, session: str) -> None:
        self.sessions.discard(session)


class Tokenizer:
    """What the batch's grammar support reads of a tokenizer, not used without a guide."""


@pytest.fixture
def stages() -> Iterator[tuple[list[str], list[StageServer], list[Adds | Head]]]:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    parts: list[Adds | Head] = [Adds(), Head()]
    servers = [StageServer(p) for p in parts]  # type: ignore[arg-type]
    addrs = [asyncio.run_coroutine_threadsafe(s.start(), loop).result(10) for s in servers]
    try:
        yield addrs, servers, parts
    finally:
        for s in servers:
            asyncio.run_coroutine_threadsafe(s.close(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


def run_to_end(batch: PipelineBatch, ids: set[str], timeout_s: float = 300) -> dict[str, list[Step]]:
    out: dict[str, list[Step]] = {i: [] for i in ids}
    deadline = time.monotonic() + timeout_s
    while any(not s or (s[-1].finish is None and not s[-1].error) for s in out.values()):
        assert time.monotonic() < deadline, out
        for step in batch.steps(0.5):
            out[step.request_id].append(step)
    return out


def tokens(steps: list[Step]) -> list[int]:
    return [t for s in steps for t, _ in s.tokens]


def test_tokens_come_from_the_last_stage_s_logits_and_end_as_asked(stages) -> None:  # type: ignore[no-untyped-def]
    addrs, _, parts = stages
    batch = PipelineBatch(addrs, Tokenizer(), VOCAB, {EOS}, kv_tokens=64)
    try:
        greedy = SamplingParams(max_tokens=4, temperature=0.0)
        batch.add("len", [3], greedy)  # 4, 5, 6, 7: stopped by max_tokens
        batch.add("eos", [12], SamplingParams(max_tokens=8, temperature=0.0))  # 13, 14, then the EOS
        batch.add("lp", [1], SamplingParams(max_tokens=2, temperature=0.0, logprobs=2))
        got = run_to_end(batch, {"len", "eos", "lp"})
        assert tokens(got["len"]) == [4, 5, 6, 7] and got["len"][-1].finish is FinishReason.LENGTH
        assert tokens(got["eos"]) == [13, 14] and got["eos"][-1].finish is FinishReason.STOP
        (first, _lp), *_ = [t for s in got["lp"] for t in s.tokens]
        logprob = got["lp"][0].tokens[0][1]
        assert first == 2 and logprob is not None and logprob.token == 2 and len(logprob.top) == 2
        wait_for(lambda: batch.active == 0, 300, "the runs to end")
        assert all(not p.sessions for p in parts)  # every session's caches dropped on the stages
    finally:
        batch.close()


def test_a_request_too_long_or_with_a_bad_grammar_is_refused_alone(stages) -> None:  # type: ignore[no-untyped-def]
    addrs, _, _ = stages
    batch = PipelineBatch(addrs, Tokenizer(), VOCAB, {EOS}, kv_tokens=8)
    try:
        with pytest.raises(ValueError, match="KV cache"):
            batch.add("long", [1] * 6, SamplingParams(max_tokens=4))
        with pytest.raises(ValueError):
            batch.add("bad", [1], SamplingParams(max_tokens=2, guide=Guide(kind="nonsense", spec="")))
        batch.add("ok", [1], SamplingParams(max_tokens=2, temperature=0.0))
        assert tokens(run_to_end(batch, {"ok"})["ok"]) == [2, 3]
    finally:
        batch.close()


def test_a_stage_gone_fails_the_request_with_its_address(stages) -> None:  # type: ignore[no-untyped-def]
    addrs, _, _ = stages
    batch = PipelineBatch([addrs[0], "127.0.0.1:1"], Tokenizer(), VOCAB, {EOS}, kv_tokens=64)
    try:
        batch.add("x", [1], SamplingParams(max_tokens=2, temperature=0.0))
        (step,) = run_to_end(batch, {"x"})["x"]
        assert "127.0.0.1:1" in step.error and step.tokens == ()
    finally:
        batch.close()

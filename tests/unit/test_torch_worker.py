"""The torch worker's binding (`torch_engine/process.py`) under the worker loop, with the engine
and its batch stood in for (`FakeBatch`: no model; the real ones run in
tests/conformance/test_batch_conformance.py and tests/e2e/test_torch_engine.py): a load binds
the engine and makes its batch on the load's threads; a load with no torch checkpoint is
refused with the bound model still serving; a batch that died is made anew; a tier-up is
answered at once (there is no other tier)."""

from __future__ import annotations

import multiprocessing
from collections.abc import Iterator
from multiprocessing.connection import Connection
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="the torch engine needs torch")

from cuda_ext import TensorArena
from services.engine.torch_engine import process as worker_module
from services.engine.torch_engine.process import TorchBinding
from services.engine.worker_loop import WorkerLoop
from services.engine.worker_wire import Done, Failure, Load, Loaded, Run, TieredUp, TierUpNow
from shared.artifact import TORCH_MANIFEST, torch_checkpoint
from shared.messages import Artifact, FinishReason, SamplingParams, Tier
from tests.helpers.fake_batch import FakeBatch


class FakeTokenizer:
    def batch_decode(self, seqs: list[list[int]], **_: object) -> list[str]:
        return [" ".join(str(t) for t in s) for s in seqs]


class FakeEngine:
    """Stands in for `TorchEngine.start`'s result."""

    tokenizer = FakeTokenizer()
    bound = type("Bound", (), {"loaded": type("Loaded", (), {"reused_bytes": 7})()})()
    closed = False

    def close(self) -> None:
        self.closed = True


def messages(engine: Connection) -> list[object]:
    out = []
    while engine.poll(0):
        out.append(engine.recv())
    return out


@pytest.fixture
def bound(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[tuple[WorkerLoop, Connection, list[FakeBatch]]]:
    batches: list[FakeBatch] = []

    def batcher(
        engine: object, max_batch: int, kv_tokens: int, gate: object, slot: int, lora: object = None
    ) -> FakeBatch:
        assert lora is None  # the artifacts here keep no LoRA adapter: the batch is built without
        batches.append(FakeBatch())
        return batches[-1]

    monkeypatch.setattr(worker_module.TorchEngine, "start", lambda *_: FakeEngine())
    monkeypatch.setattr(worker_module, "ContinuousBatcher", batcher)
    engine_end, worker_end = multiprocessing.Pipe()
    loop = WorkerLoop(worker_end, TorchBinding(TensorArena(1 << 20, device="cpu")), threads=3)
    yield loop, engine_end, batches
    engine_end.close()
    worker_end.close()


def artifact(tmp_path: Path, checkpoint: bool = True) -> Artifact:
    a = Artifact("a", str(tmp_path), "s", 2048, 1, 1)
    if checkpoint:
        torch_checkpoint(a).mkdir(exist_ok=True)
        (torch_checkpoint(a) / TORCH_MANIFEST).write_text("{}")  # what the binding checks is there
    return a


def test_a_load_binds_the_engine_and_its_batch_on_the_load_s_threads(bound, tmp_path: Path) -> None:
    loop, engine, batches = bound
    loop.handle(Load(artifact(tmp_path), cores=None))
    (loaded,) = messages(engine)
    assert isinstance(loaded, Loaded) and loaded.reused_bytes == 7
    assert len(batches) == 1 and batches[0].threads == 3
    loop.handle(Run("r", "s", (1, 2), SamplingParams(max_tokens=2, temperature=0.0), 0.0))
    loop.turn(0.0)
    loop.turn(0.0)
    done = [m for m in messages(engine) if isinstance(m, Done)]
    assert [(d.finish_reason, d.completion_tokens) for d in done] == [(FinishReason.LENGTH, 2)]


def test_a_load_with_no_torch_checkpoint_is_refused_with_the_bound_model_serving(bound, tmp_path: Path) -> None:
    loop, engine, batches = bound
    loop.handle(Load(artifact(tmp_path), cores=None))
    messages(engine)
    loop.handle(Load(artifact(tmp_path / "missing", checkpoint=False), cores=None))
    (failure,) = messages(engine)
    assert isinstance(failure, Failure) and "no torch checkpoint" in failure.message
    assert loop.batch is batches[0] and not batches[0].closed


def test_a_dead_batch_is_made_anew_by_the_binding(bound, tmp_path: Path) -> None:
    loop, _engine, batches = bound
    loop.handle(Load(artifact(tmp_path), cores=None))
    batches[0].alive = False
    loop.handle(Run("r", "s", (1,), SamplingParams(max_tokens=1, temperature=0.0), 0.0))
    loop.turn(0.0)
    assert len(batches) == 2 and batches[0].closed and batches[1].added == ["r"] and batches[1].threads == 3


def test_a_tier_up_is_answered_on_the_one_tier(bound, tmp_path: Path) -> None:
    loop, engine, _ = bound
    loop.handle(TierUpNow())
    assert messages(engine) == [TieredUp(Tier.TORCH, 0.0, "no model loaded")]
    loop.handle(Load(artifact(tmp_path), cores=None))
    messages(engine)
    loop.handle(TierUpNow())
    assert messages(engine) == [TieredUp(Tier.TORCH, 0.0, "")]

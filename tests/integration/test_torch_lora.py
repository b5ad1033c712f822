"""LoRA adapters on the torch engine's batch (issue 34), each row its own adapter in one step
(`services/engine/torch_engine/lora.py`), on a tiny Llama checkpoint with adapters drawn here:
every request's greedy tokens are transformers' greedy tokens with that request's adapter merged
into the weights (or none), whatever its neighbours in the batch run; more adapters at once
than the batch has slots wait for one; an adapter on linears or of a rank the batch was not
built for waits for the batch to drain, which is then built again for it."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest

torch = pytest.importorskip("torch", reason="the torch engine needs torch (the `test` extra installs it)")

from cuda_ext import TensorArena  # noqa: E402
from services.engine.batch_types import Step  # noqa: E402
from services.engine.torch_engine.batching import ContinuousBatcher  # noqa: E402
from services.engine.torch_engine.engine import TorchEngine  # noqa: E402
from services.engine.torch_engine.lora import MAX_LORAS, LoraShape, kept_shape  # noqa: E402
from shared.adapters import ADAPTER_MANIFEST, ADAPTER_WEIGHTS, AdapterArtifact  # noqa: E402
from shared.messages import AdapterRef, FinishReason, SamplingParams  # noqa: E402
from tests.helpers.adapters import merged_greedy, write_adapter  # noqa: E402
from tests.unit.test_torch_batch_tiny import tiny_checkpoint  # noqa: E402

TOKENS = 10
PROMPT = "hello there"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_checkpoint(tmp_path_factory.mktemp("tiny-lora"))


def kept(
    base: Path, dest: Path, seed: int, rank: int = 8, targets: tuple[str, ...] = ("q_proj", "v_proj")
) -> AdapterRef:
    """An adapter drawn from `seed`, kept as the store keeps one (PEFT's files and a manifest)."""
    write_adapter(base, dest, seed=seed, rank=rank, alpha=16, targets=targets)
    weights = (dest / ADAPTER_WEIGHTS).read_bytes()
    artifact = AdapterArtifact(
        adapter_id=f"seed{seed}",
        path=str(dest),
        base_artifact_id="tiny",
        rank=rank,
        alpha=16.0,
        scale=16 / rank,
        targets=targets,
        layers=2,
        dtype="F32",
        nbytes=len(weights),
        sha256=hashlib.sha256(weights).hexdigest(),
    )
    (dest / ADAPTER_MANIFEST).write_bytes(msgspec.json.encode(artifact))
    return AdapterRef(dest.name, artifact.adapter_id, str(dest), artifact.scale, len(weights), 60.0)


@pytest.fixture
def engine(checkpoint: Path) -> Iterator[TorchEngine]:
    e = TorchEngine.start(checkpoint, TensorArena(64 << 20, device="cpu"))
    try:
        yield e
    finally:
        e.close()


def prompt_of(engine: TorchEngine) -> list[int]:
    return list(engine.tokenizer(PROMPT, add_special_tokens=False)["input_ids"])


def run(batch: ContinuousBatcher, requests: dict[str, AdapterRef | None], prompt: list[int]) -> dict[str, list[Step]]:
    params = SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True)
    for rid, adapter in requests.items():
        if adapter is None:
            batch.add(rid, prompt, params)
        else:
            batch.add_adapted(rid, prompt, params, lambda _: float("inf"), 0, adapter)
    out: dict[str, list[Step]] = {rid: [] for rid in requests}
    deadline = time.monotonic() + 120
    while not all(s and s[-1].finish is not None for s in out.values()):
        assert time.monotonic() < deadline, f"the batch never ended: {out}"
        for step in batch.steps(0.05):
            assert not step.error, step.error
            out[step.request_id].append(step)
    assert batch.active == 0
    return out


def tokens_of(steps: list[Step]) -> list[int]:
    assert steps[-1].finish is FinishReason.LENGTH
    return [t for s in steps for t, _ in s.tokens]


def test_each_row_gets_its_own_adapter_in_one_step(engine: TorchEngine, checkpoint: Path, tmp_path: Path) -> None:
    a = kept(checkpoint, tmp_path / "ad-a", seed=1)
    b = kept(checkpoint, tmp_path / "ad-b", seed=2, rank=4, targets=("q_proj", "v_proj", "up_proj", "down_proj"))
    prompt = prompt_of(engine)
    expected = {
        None: merged_greedy(checkpoint, None, prompt, TOKENS),
        "ad-a": merged_greedy(checkpoint, Path(a.path), prompt, TOKENS),
        "ad-b": merged_greedy(checkpoint, Path(b.path), prompt, TOKENS),
    }
    assert len({tuple(t) for t in expected.values()}) == 3  # the adapters change the answer
    shape = kept_shape(
        [msgspec.json.decode((Path(r.path) / ADAPTER_MANIFEST).read_bytes(), type=AdapterArtifact) for r in (a, b)]
    )
    assert shape == LoraShape(frozenset({"q_proj", "v_proj", "up_proj", "down_proj"}), 8)
    batch = ContinuousBatcher(engine, max_batch=8, kv_tokens=256, lora=shape)
    try:
        requests = {"base": None, "a1": a, "b1": b, "a2": a, "base2": None}
        got = run(batch, requests, prompt)
        again = run(batch, {"b3": b, "base3": None}, prompt)  # the slots kept, nothing read again
    finally:
        batch.close()
    for rid, adapter in requests.items():
        assert tokens_of(got[rid]) == expected[adapter.name if adapter else None], rid
    assert tokens_of(again["b3"]) == expected["ad-b"] and tokens_of(again["base3"]) == expected[None]
    # Each adapter was read once, at its first request, and said so with that request's steps.
    loads = {rid: s.adapter_load for rid, steps in {**got, **again}.items() for s in steps if s.adapter_load}
    assert sorted((rid, load.name) for rid, load in loads.items()) == [("a1", "ad-a"), ("b1", "ad-b")]


def test_more_adapters_than_slots_wait_for_one_and_each_gets_its_own(
    engine: TorchEngine, checkpoint: Path, tmp_path: Path
) -> None:
    refs = [kept(checkpoint, tmp_path / f"ad-{i}", seed=10 + i) for i in range(MAX_LORAS + 1)]
    prompt = prompt_of(engine)
    batch = ContinuousBatcher(engine, max_batch=8, kv_tokens=256, lora=LoraShape(frozenset({"q_proj", "v_proj"}), 8))
    try:
        got = run(batch, {r.name: r for r in refs}, prompt)
    finally:
        batch.close()
    for r in refs:
        assert tokens_of(got[r.name]) == merged_greedy(checkpoint, Path(r.path), prompt, TOKENS), r.name


def test_an_adapter_the_batch_was_not_built_for_waits_for_the_drain_then_is_served(
    engine: TorchEngine, checkpoint: Path, tmp_path: Path
) -> None:
    """A batch built for no adapter (none was kept when its model started) meets one on the
    MLP's linears: the base's request running finishes first, then the batch is built again,
    LoRA-able, and both the adapter's request and a base request sent after it are served."""
    mlp = kept(checkpoint, tmp_path / "ad-mlp", seed=5, rank=16, targets=("gate_proj", "down_proj"))
    prompt = prompt_of(engine)
    batch = ContinuousBatcher(engine, max_batch=8, kv_tokens=256)
    try:
        assert batch.loras is None
        got = run(batch, {"base": None, "mlp": mlp, "after": None}, prompt)
        assert batch.loras is not None and batch.loras.shape.covers(("gate_proj",), 16)
    finally:
        batch.close()
    assert tokens_of(got["mlp"]) == merged_greedy(checkpoint, Path(mlp.path), prompt, TOKENS)
    base = merged_greedy(checkpoint, None, prompt, TOKENS)
    assert tokens_of(got["base"]) == base and tokens_of(got["after"]) == base
    # The base's first request ran before the rebuild, the one behind the adapter after it.
    assert got["base"][-1].finish is not None


def test_an_adapter_waiting_for_a_slot_is_not_passed_by_the_adapter_draining_for_it(
    engine: TorchEngine, checkpoint: Path, tmp_path: Path
) -> None:
    """Every slot busy and a ninth adapter waits: the loaded adapter with the fewest rows (the
    first slot, at a tie) takes no new rows until its slot is free for the waiter, so a later
    request for it starts after the waiter's, while the base's requests go on meanwhile."""
    refs = [kept(checkpoint, tmp_path / f"ad-{i}", seed=20 + i) for i in range(MAX_LORAS + 1)]
    prompt = prompt_of(engine)
    params = SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True)
    batch = ContinuousBatcher(engine, max_batch=16, kv_tokens=512, lora=LoraShape(frozenset({"q_proj", "v_proj"}), 8))
    order: list[str] = []
    out: dict[str, list[Step]] = {}
    try:
        for r in refs[:MAX_LORAS]:
            batch.add_adapted(r.name, prompt, params, lambda _: float("inf"), 0, r)
        batch.add_adapted("waiter", prompt, params, lambda _: float("inf"), 0, refs[-1])
        batch.add_adapted("again", prompt, params, lambda _: float("inf"), 0, refs[0])
        batch.add("base", prompt, params)
        deadline = time.monotonic() + 120
        while len([rid for rid, s in out.items() if s[-1].finish is not None]) < MAX_LORAS + 3:
            assert time.monotonic() < deadline, f"the batch never ended: {out}"
            for step in batch.steps(0.05):
                assert not step.error, step.error
                if step.tokens and step.request_id not in order:
                    order.append(step.request_id)
                out.setdefault(step.request_id, []).append(step)
    finally:
        batch.close()
    assert order.index("base") < order.index("waiter") < order.index("again")
    assert tokens_of(out["waiter"]) == merged_greedy(checkpoint, Path(refs[-1].path), prompt, TOKENS)
    assert tokens_of(out["again"]) == tokens_of(out[refs[0].name])

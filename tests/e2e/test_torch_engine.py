"""The torch engine on the host with the real default model: the GGUF materialized once into a
torch checkpoint, started on the tensor arena's host fallback, generating with transformers'
model code; a second start finds every tensor resident and reads nothing."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="the torch engine needs torch (the `test` extra installs it)")

import torch
from transformers import AutoModelForCausalLM

from cuda_ext import TensorArena
from ops.localcluster import default_model_path
from services.engine.torch_engine.engine import TorchEngine, read_manifest
from services.loader.torch_checkpoint import materialize
from shared.messages import SamplingParams

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # float32: the host's matmuls (bf16 has no fast path on this CPU).
    return materialize(default_model_path(), tmp_path_factory.mktemp("torch") / "smol", dtype=torch.float32)


@pytest.fixture(scope="module")
def arena() -> TensorArena:
    return TensorArena(1 << 30, device="cpu")


@pytest.fixture
def engine(checkpoint: Path, arena: TensorArena) -> Iterator[TorchEngine]:
    engine = TorchEngine.start(checkpoint, arena)
    yield engine
    engine.close()


def test_the_materialized_checkpoint_names_every_tensor_with_its_digest(checkpoint: Path) -> None:
    specs = read_manifest(checkpoint)
    assert specs[0].name == "model.embed_tokens.weight"  # access order: the embedding is read first
    assert len({s.name for s in specs}) == len(specs) == 272  # 30 layers × 9 + embedding + norm (head tied)
    assert all(len(s.digest) == 64 and s.dtype == torch.float32 for s in specs)


def test_greedy_decoding_is_transformers_own(engine: TorchEngine, checkpoint: Path) -> None:
    prompt = engine.chat_ids(QUESTION)
    mine = engine.generate(prompt, SamplingParams(max_tokens=12, temperature=0.0))
    plain = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    with torch.inference_mode():
        out = plain.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)
    theirs = out[0, len(prompt) :].tolist()
    n = min(len(mine.token_ids), len(theirs))
    assert n >= 4 and mine.token_ids[:n] == theirs[:n]
    assert "Paris" in mine.text


def test_a_seeded_sample_repeats_and_stops_at_its_length(engine: TorchEngine) -> None:
    prompt = engine.chat_ids(QUESTION)
    params = SamplingParams(max_tokens=8, temperature=0.9, top_p=0.95, seed=7, ignore_eos=True)
    first, again = engine.generate(prompt, params), engine.generate(prompt, params)
    assert first == again
    assert first.finish_reason == "length" and len(first.token_ids) == 8


def test_a_start_after_scale_to_zero_reads_no_weight(checkpoint: Path, arena: TensorArena) -> None:
    cold = TorchEngine.start(checkpoint, arena)
    prompt = cold.chat_ids(QUESTION)
    expected = cold.generate(prompt, SamplingParams(max_tokens=6, temperature=0.0))
    cold.close()  # scaled to zero: resident, idle
    warm = TorchEngine.start(checkpoint, arena)
    try:
        assert warm.read_bytes == 0 and warm.loaded.copied_bytes == 0
        assert warm.loaded.reused_bytes == sum(s.nbytes for s in read_manifest(checkpoint))
        assert warm.generate(prompt, SamplingParams(max_tokens=6, temperature=0.0)) == expected
    finally:
        warm.close()

"""The OpenVINO engine's batches on the default model (SmolLM2-135M), for the batch conformance
suite (`test_batch_conformance.py`) and their own unit tests: each factory returns a fresh batch
and the model's `decode_many` (token id sequences in, their texts out, special tokens skipped).

The model is converted and materialized (both tiers compiled) once per process, and the core's
pipeline (≈ 2.5 s to build) built once and shared by the core batches made from it: close a
batch when done with it, so that its requests leave the pipeline."""

from __future__ import annotations

import atexit
import functools
import shutil
import tempfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from services.engine.batch import StartBatch, vocab_size
from services.engine.core import CoreBatch
from services.engine.instance import LoadedModel
from services.engine.step_gate import TakeTurn, Turn, no_turn
from services.engine.text import DecodeMany
from services.engine.tiered_batch import TieredBatch
from shared.messages import Artifact, Tier

THREADS = 1
"""The test machine's cores are shared: one thread each."""


@functools.cache
def smol_artifact() -> Artifact:
    """The default model as the loader stores it: converted from its GGUF and materialized."""
    from ops.localcluster import default_model_path
    from services.loader.convert import convert, materialize

    home = Path(tempfile.mkdtemp(prefix="tessera-smol-"))
    atexit.register(shutil.rmtree, home, True)
    artifact = convert(default_model_path(), home / "smol", "0" * 64, "unit-test")
    materialize(artifact, "CPU", THREADS)
    return artifact


@functools.cache
def start_tier() -> LoadedModel:
    import openvino as ov

    return LoadedModel.load(ov.Core(), smol_artifact(), "CPU", THREADS, tier=Tier.START)


@functools.cache
def core_pipeline() -> Any:
    from services.engine.core import build_pipeline

    return build_pipeline(smol_artifact().path, "CPU", THREADS)


@functools.cache
def encoder() -> Any:
    import openvino_genai as ov_genai

    return ov_genai.Tokenizer(smol_artifact().path)


def encode(text: str) -> list[int]:
    """`text`'s token ids (no special tokens added), as the gateway would send them."""
    return [int(t) for t in encoder().encode(text, add_special_tokens=False).input_ids.data[0]]


def start_batch_factory(
    turn: TakeTurn = no_turn,
    max_batch: int = 4,
    join_recompute_tokens: int = 512,
) -> tuple[StartBatch, DecodeMany]:
    loaded = start_tier()
    batch = StartBatch(
        loaded.compiled, loaded.eos_ids, loaded.artifact.context_length, turn, max_batch, join_recompute_tokens
    )
    return batch, loaded.tokenizer.decode_many


def core_batch_factory(turn: TakeTurn = no_turn) -> tuple[CoreBatch, DecodeMany]:
    loaded = start_tier()  # its detokenizer and vocabulary are the model's
    batch = CoreBatch(core_pipeline(), loaded.tokenizer.eos_token_id, vocab_size(loaded.compiled), kv_tokens(), turn)
    return batch, loaded.tokenizer.decode_many


def kv_tokens() -> int:
    """The most a request may hold in either batch (the model's context): a longer one is refused."""
    return smol_artifact().context_length


def decode(ids: Sequence[int]) -> str:
    """The library's own detokenization of a completion's ids (special tokens skipped)."""
    return start_tier().tokenizer.decode(ids)


PROMPT = "The capital of France is"
"""A prompt the model ends by itself (an end of sequence) within 20 tokens, greedy, on either tier."""


class TurnLog:
    """Stands in for the node's step gate (`TakeTurn`, `idle`): the deadline each turn was entered
    with, the one it was left posted with (`Turn.then`), and how often the batch said it had
    nothing left to run."""

    def __init__(self) -> None:
        self.entered: list[float] = []
        self.left: list[float] = []
        self.idles = 0

    @contextmanager
    def __call__(self, deadline: float) -> Iterator[Turn]:
        self.entered.append(deadline)
        held = Turn()
        yield held
        self.left.append(held.then)

    def idle(self) -> None:
        self.idles += 1


def run_out(batch: Any, limit: int = 2000) -> dict[str, list[Any]]:
    """Step `batch` until it has nothing left (at most `limit` steps): every step each request
    got, in order."""
    steps: dict[str, list[Any]] = {}
    for _ in range(limit):
        if not batch.active:
            return steps
        for step in batch.steps(0.05):
            steps.setdefault(step.request_id, []).append(step)
    raise AssertionError(f"the batch still had {batch.active} requests after {limit} steps")


def token_ids(steps: list[Any]) -> list[int]:
    return [t for step in steps for t, _ in step.tokens]


def tiered_batch_factory(
    turn: TakeTurn = no_turn, idle: Callable[[], None] = lambda: None
) -> tuple[TieredBatch, DecodeMany]:
    """The worker's batch over both tiers: the start tier at once, its core built on a thread
    after the first batch (each such batch builds its own: ≈ 2.5 s of CPU)."""
    import openvino as ov

    loaded = start_tier()

    def reload() -> LoadedModel:
        return LoadedModel.load(ov.Core(), loaded.artifact, "CPU", THREADS, tier=Tier.START, tokenizer=loaded.tokenizer)

    batch = TieredBatch(loaded, reload, "CPU", THREADS, turn, max_batch=4, join_recompute_tokens=512, idle=idle)
    return batch, loaded.tokenizer.decode_many

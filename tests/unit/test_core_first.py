"""An artifact without a start tier (its packed weights above the loader's
`start_tier_max_weight_bytes`), on the real default model with that limit at 0 bytes: the
loader writes and compiles no start tier and records so; a worker's `Load` answers at once
(no tier loaded; the core's build begins on the load, in the background); the first request
is served by the core, its text the core's own greedy output; a request that needs the logits
is served on the stateful STEADY tier, loaded for it."""

from __future__ import annotations

import shutil
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import openvino as ov
import pytest

from services.engine import core as core_module
from services.engine.backends import OPENVINO
from services.engine.core import generation_config
from services.engine.instance import LoadedModel
from services.engine.tiered_batch import TieredBatch
from services.engine.worker_process import OpenVinoBinding
from services.engine.worker_wire import Load
from services.loader.convert import main as convert_main
from services.loader.settings import LoaderSettings
from services.loader.start_ir import start_tier_wins
from services.loader.store import read_artifact
from shared.artifact import START_DIR, compiled_cache_dir, has_tier, is_materialized
from shared.messages import Artifact, SamplingParams, Tier, WeightFormat
from tests.conformance.ovbatches import THREADS, encode, run_out, token_ids

MIB = 1024**2
STORY = encode("Once upon a time, in a land far away,")
BUILD_S = 600.0
"""Longest a core build may take on a loaded test machine (≈ 2.5 s alone)."""


def greedy(max_tokens: int, **kw: Any) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


def test_the_start_tier_is_kept_only_up_to_the_limit() -> None:
    limit = LoaderSettings().start_tier_max_weight_bytes
    assert limit == 512 * MIB
    assert start_tier_wins(92 * MIB, limit)  # SmolLM2-135M's packed weights
    assert start_tier_wins(limit, limit)
    assert not start_tier_wins(limit + 1, limit)
    # No u4 to widen: the start tier would be the same IR twice.
    assert not start_tier_wins(92 * MIB, limit, WeightFormat.INT8)
    assert not start_tier_wins(92 * MIB, limit, WeightFormat.F16)
    assert not start_tier_wins(917 * 1000**2, limit)  # SmolLM2-1.7B's
    assert not start_tier_wins(1, 0)


@pytest.fixture(scope="module")
def big() -> Iterator[Artifact]:
    """The default model imported as the loader's converter does (`convert.main`, its settings
    from the environment), with `start_tier_max_weight_bytes` at 0: every model is 'large'."""
    from ops.localcluster import default_model_path

    home = Path(tempfile.mkdtemp(prefix="tessera-core-first-"))
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("TESSERA_START_TIER_MAX_WEIGHT_BYTES", "0")
            convert_main([str(default_model_path()), str(home / "big"), "1" * 64, "core-first", "CPU", str(THREADS)])
        artifact = read_artifact(home / "big")
        assert artifact is not None
        yield artifact
    finally:
        shutil.rmtree(home, ignore_errors=True)


def test_the_loader_writes_and_compiles_no_start_tier_above_the_limit_and_records_it(big: Artifact) -> None:
    assert not big.start_tier
    assert not (Path(big.path) / START_DIR).exists()
    assert not compiled_cache_dir(big, "CPU", Tier.START).exists()
    assert has_tier(big, "CPU", Tier.STEADY) and is_materialized(big, "CPU")
    assert OPENVINO.start_tier_of(big, "CPU", enabled=True) == Tier.STEADY  # what the engine's Load names
    # The engine's stateful model for the logits' requests: the STEADY blob, imported.
    loaded = LoadedModel.load(ov.Core(), big, "CPU", THREADS, tier=Tier.STEADY)
    assert loaded.loaded_from_cache


class HeldBuild:
    """Holds the core's build (the real one, `core.build_pipeline`) until `go` is set: what
    happens before it finishes is then seen for certain."""

    def __init__(self) -> None:
        self.go = threading.Event()
        self.began = threading.Event()
        self._build = core_module.build_pipeline

    def __call__(self, *args: Any) -> Any:
        self.began.set()
        assert self.go.wait(BUILD_S)
        return self._build(*args)


@pytest.fixture
def held(monkeypatch: pytest.MonkeyPatch) -> Iterator[HeldBuild]:
    build = HeldBuild()
    monkeypatch.setattr(core_module, "build_pipeline", build)
    yield build
    build.go.set()


@pytest.fixture
def opened(big: Artifact, held: HeldBuild) -> Iterator[tuple[OpenVinoBinding, TieredBatch]]:
    binding = OpenVinoBinding(ov.Core(), "CPU", THREADS, max_batch=4)
    bound = binding.load(Load(artifact=big, cores=None, tier=Tier.STEADY), THREADS)
    assert isinstance(bound.batch, TieredBatch)
    yield binding, bound.batch
    held.go.set()
    bound.batch.close()


def core_alone(batch: TieredBatch, prompt: list[int], params: SamplingParams) -> list[int]:
    """What the batch's core generates for one request by itself (the library's `generate`)."""
    assert batch.core is not None and batch.core.active == 0
    (result,) = batch.core.pipeline.generate(
        [ov.Tensor(np.asarray([prompt], dtype=np.int64))], [generation_config(params, batch.tokenizer.eos_token_id)]
    )
    return [int(t) for t in result.m_generation_ids[0]]


def test_a_load_answers_before_the_core_is_built_and_the_first_request_is_the_cores(
    opened: tuple[OpenVinoBinding, TieredBatch], held: HeldBuild
) -> None:
    _, batch = opened
    # The Load was answered (`binding.load` returned) with the build begun and not finished,
    # and no stateful tier loaded.
    assert batch.core_first and batch.start is None and not batch.loaded_from_cache
    assert batch.building and held.began.wait(BUILD_S) and batch.build is not None
    assert not batch.build.done.is_set()
    params = greedy(12)
    batch.add("first", STORY, params)
    assert batch.start is None and batch.core is None  # it waits for the core
    held.go.set()
    assert batch.build.done.wait(BUILD_S)
    got = token_ids(run_out(batch)["first"])
    assert batch.core is not None and batch.start is None  # served by the core alone
    assert got == core_alone(batch, STORY, params)
    up = batch.poll_tier_up()
    assert up is not None and up.tier == Tier.STEADY and not up.error


def test_a_request_that_needs_the_logits_is_served_on_the_steady_stateful_tier(
    opened: tuple[OpenVinoBinding, TieredBatch], held: HeldBuild
) -> None:
    _, batch = opened
    bias = 504
    batch.add("biased", STORY, greedy(6, logit_bias=((bias, 100.0),)))
    assert batch.start is not None and batch.core is None  # loaded for it, the core still building
    steps = run_out(batch)
    assert token_ids(steps["biased"]) == [bias] * 6
    held.go.set()
    assert batch.build is not None and batch.build.done.wait(BUILD_S)
    assert batch.poll_tier_up() is not None  # the core adopted; the idle stateful tier goes
    assert batch.core is not None and batch.start is None
    batch.add("plain", STORY, greedy(4))
    assert len(token_ids(run_out(batch)["plain"])) == 4

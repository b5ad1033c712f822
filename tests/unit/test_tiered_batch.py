"""One batch over the OpenVINO worker's two tiers (`tiered_batch.TieredBatch`) on the real
default model: a running request moves to the core mid-stream without a token lost or
repeated, the logits' requests stay on (or bring back) the start tier, requests only the core
serves wait for it, and a core that fails to build leaves the start tier serving and refuses
grammars."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator

import msgspec
import numpy as np
import openvino as ov
import pytest

from services.engine.core import generation_config
from services.engine.instance import LoadedModel
from services.engine.tiered_batch import NO_GRAMMAR, TieredBatch
from shared.artifact import model_xml
from shared.messages import FinishReason, Guide, SamplingParams, Tier
from tests.conformance.ovbatches import THREADS, TurnLog, encode, run_out, start_tier, token_ids
from tests.unit.test_cpu_share import resident_bytes_of

STORY = encode("Once upon a time, in a land far away,")
QUESTION = encode("What is the tallest mountain?")
BUILD_S = 600.0
"""Longest a core build may take on a loaded test machine (≈ 2.5 s alone)."""


def greedy(max_tokens: int, **kw: object) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)  # type: ignore[arg-type]


def tiered_batch(
    loaded: LoadedModel, first_batch_done: list[int] | None = None, gate: TurnLog | None = None
) -> TieredBatch:
    def reload() -> LoadedModel:
        return LoadedModel.load(ov.Core(), loaded.artifact, "CPU", THREADS, tier=Tier.START, tokenizer=loaded.tokenizer)

    def done() -> None:
        if first_batch_done is not None:
            first_batch_done.append(1)

    gate = gate or TurnLog()
    return TieredBatch(loaded, reload, "CPU", THREADS, gate, max_batch=4, first_batch_done=done, idle=gate.idle)


@pytest.fixture
def tiered() -> Iterator[TieredBatch]:
    batch = tiered_batch(start_tier())
    yield batch
    batch.close()


def core_alone(batch: TieredBatch, prompt: list[int], params: SamplingParams) -> list[int]:
    """What the batch's core generates for one request by itself (the library's `generate`)."""
    assert batch.core is not None and batch.core.active == 0
    eos = batch.tokenizer.eos_token_id
    (result,) = batch.core.pipeline.generate(
        [ov.Tensor(np.asarray([prompt], dtype=np.int64))], [generation_config(params, eos)]
    )
    ids = [int(t) for t in result.m_generation_ids[0]]
    return ids[:-1] if ids and ids[-1] == eos and not params.ignore_eos else ids


def wait_for_core(batch: TieredBatch) -> None:
    assert batch.build is not None, "no build under way"
    assert batch.build.done.wait(BUILD_S), "the core's build did not finish"


def test_a_running_request_moves_to_the_core_mid_stream_without_a_token_lost_or_repeated(
    tiered: TieredBatch,
) -> None:
    tiered.add("a", STORY, greedy(24))
    tiered.add("logits", QUESTION, greedy(24, logprobs=3))
    seen: dict[str, list[int]] = {"a": [], "logits": []}
    prefilled = set()
    for _ in range(4):
        for step in tiered.steps(0.05):
            seen[step.request_id] += [t for t, _ in step.tokens]
            prefilled.add(step.prefill_tokens)
    assert prefilled == {2 * max(len(STORY), len(QUESTION))}  # both rows padded to the longest
    assert tiered.tier == Tier.START and not tiered.building and len(seen["a"]) == 4
    assert tiered.tier_up_now() is None and tiered.building  # the node is idle: build now
    wait_for_core(tiered)
    up = tiered.poll_tier_up()
    assert up is not None and up.tier == Tier.STEADY and not up.error and up.load_s > 0
    assert tiered.tier == Tier.STEADY and tiered.poll_tier_up() is None
    assert tiered.start is not None  # the logits' request runs on
    rest = run_out(tiered)
    assert len(seen["a"] + token_ids(rest["a"])) == 24 and rest["a"][-1].finish == FinishReason.LENGTH
    # On the core, "a" went on from its next token: what the core makes of its context so far.
    assert token_ids(rest["a"]) == core_alone(tiered, STORY + seen["a"], greedy(20))
    # On the core its steps tell no prefill of their own (the worker keeps the most any said).
    assert max(s.prefill_tokens for s in rest["a"]) == 0
    begun, ended = tiered.build_window
    assert begun < ended < float("inf")
    # The logits' request stayed on the start tier, every token with its alternatives.
    logits = [pair for step in rest["logits"] for pair in step.tokens]
    assert len(seen["logits"]) + len(logits) == 24
    assert all(lp is not None and len(lp.top) == 3 for _, lp in logits)
    # Nothing runs on the start tier any more: its memory went back.
    assert tiered.start is None and tiered.active == 0 and tiered.kv_bytes > 0


def test_requests_only_the_core_serves_wait_for_it_and_its_weights_file_leaves_the_rss(tiered: TieredBatch) -> None:
    seeded = SamplingParams(max_tokens=12, temperature=0.9, seed=5, top_k=40)
    tiered.add("seeded", STORY, seeded)
    assert tiered.building and tiered.active == 1  # asked for the core: built now
    steps = run_out(tiered)["seeded"]  # its steps wait for the build, then run on the core
    # The core's first pass repacked the IR's weights: the file's pages left this process's
    # RSS, where they would count a second time in its footprint. What stays is the part the
    # CPU plugin reads in place, the embedding table's rows: a few of them on an Intel Xeon
    # with AMX, 10.6 MB of the 92 MB file on an AMD EPYC with AVX-512 bf16 (the table, u8, is 28 MB).
    weights = model_xml(tiered.artifact).with_suffix(".bin")
    assert resident_bytes_of(weights) < weights.stat().st_size // 4
    assert tiered.tier == Tier.STEADY and tiered.build_window[1] < float("inf")
    assert token_ids(steps) == core_alone(tiered, STORY, seeded)
    up = tiered.poll_tier_up()
    assert up is not None and up.tier == Tier.STEADY and tiered.poll_tier_up() is None
    answer = tiered.tier_up_now()  # nothing left to build: answered at once
    assert answer is not None and answer.tier == Tier.STEADY and not answer.error


def test_the_core_is_built_after_the_first_batch_and_logits_bring_the_start_tier_back() -> None:
    calls: list[int] = []
    gate = TurnLog()
    tiered = tiered_batch(start_tier(), calls, gate)
    try:
        tiered.add("a", QUESTION, greedy(3))
        run_out(tiered)
        assert calls == [1] and tiered.building  # the start's share ends, then the core is built
        wait_for_core(tiered)
        assert tiered.poll_tier_up() is not None and tiered.start is None  # it served nothing: gone
        tiered.add("plain", STORY, greedy(6))
        tiered.add("biased", QUESTION, greedy(6, logit_bias=((504, 100.0),)))
        assert tiered.start is not None and tiered.start.active == 1  # loaded again, for it alone
        assert tiered.core is not None and tiered.core.active == 1
        steps = run_out(tiered)
        assert token_ids(steps["biased"]) == [504] * 6 and len(token_ids(steps["plain"])) == 6
        assert calls == [1] and tiered.start is None
        # Both tiers' passes took turns; a cancel that leaves nothing to run takes the posting down.
        assert gate.left[-1] == math.inf and gate.idles == 0 and tiered.waited >= 0.0
        tiered.add("c", STORY, greedy(50))
        tiered.steps(0.05)
        tiered.cancel("c")
        assert gate.idles == 1 and tiered.active == 0
    finally:
        tiered.close()


def test_a_core_that_fails_to_build_leaves_the_start_tier_serving_and_refuses_grammars() -> None:
    loaded = start_tier()
    broken = dataclasses.replace(loaded, artifact=msgspec.structs.replace(loaded.artifact, path="/nonexistent"))
    tiered = tiered_batch(broken)
    try:
        guide = Guide(kind="regex", spec="[a-z]+")
        tiered.add("guided", STORY, SamplingParams(max_tokens=4, guide=guide))
        tiered.add("seeded", STORY, SamplingParams(max_tokens=4, temperature=0.9, seed=5))
        assert tiered.building or tiered.build_failed  # a build of a missing path may fail at once
        steps = run_out(tiered)
        assert steps["guided"] == [steps["guided"][0]] and steps["guided"][0].error == NO_GRAMMAR
        assert len(token_ids(steps["seeded"])) == 4  # on the start tier's sampler, after all
        up = tiered.poll_tier_up()
        assert up is not None and up.tier == Tier.START and up.error
        with pytest.raises(ValueError, match="structured output"):
            tiered.add("guided again", STORY, SamplingParams(max_tokens=4, guide=guide))
        answer = tiered.tier_up_now()
        assert answer is not None and answer.tier == Tier.START and answer.error and not tiered.building
    finally:
        tiered.close()

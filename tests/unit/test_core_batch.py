"""The continuous-batching core as a `Batch` (`core.CoreBatch`) on the real default model:
token ids the library's own generation makes, ends of sequence and max_tokens, cancels, a bad
request failing alone, requests batched and joining mid-batch, the turn it steps in."""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np
import pytest

from services.engine.core import CoreBatch, generation_config
from shared.messages import FinishReason, SamplingParams
from tests.conformance.ovbatches import (
    TurnLog,
    core_batch_factory,
    core_pipeline,
    encode,
    kv_tokens,
    run_out,
    start_tier,
    token_ids,
)

FRANCE = encode("The capital of France is")
"""Greedy, the model ends this prompt within 20 tokens."""
STORY = encode("Once upon a time, in a land far away,")


def greedy(max_tokens: int, **kw: object) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)  # type: ignore[arg-type]


def library(*requests: tuple[list[int], SamplingParams]) -> list[list[int]]:
    """The tokens the library's own generation makes for `requests` run together (the end of
    sequence dropped), on the same pipeline."""
    import openvino as ov

    eos = start_tier().tokenizer.eos_token_id
    results = core_pipeline().generate(
        [ov.Tensor(np.asarray([prompt], dtype=np.int64)) for prompt, _ in requests],
        [generation_config(params, eos) for _, params in requests],
    )
    out = []
    for (_, params), result in zip(requests, results, strict=True):
        ids = [int(t) for t in result.m_generation_ids[0]]
        out.append(ids[:-1] if ids and ids[-1] == eos and not params.ignore_eos else ids)
    return out


@pytest.fixture
def core() -> Iterator[CoreBatch]:
    batch, _ = core_batch_factory()
    yield batch
    batch.close()


def test_greedy_and_seeded_tokens_are_the_librarys_own(core: CoreBatch) -> None:
    seeded = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, seed=11, repetition_penalty=1.1)
    # Together: a seeded sample depends on the batch it ran in (the library's, as before).
    g, s = library((STORY, greedy(16)), (STORY, seeded))
    expected = {"g": g, "s": s}
    core.add("g", STORY, greedy(16))
    core.add("s", STORY, seeded)
    steps = run_out(core)
    assert {rid: token_ids(s) for rid, s in steps.items()} == expected
    core.add("alone", STORY, seeded)
    assert token_ids(run_out(core)["alone"]) == library((STORY, seeded))[0]
    assert all(s[-1].finish == FinishReason.LENGTH for s in steps.values())
    assert all(step.prefill_tokens == 0 for s in steps.values() for step in s)  # its prompt's
    assert core.kv_bytes > 0 and core.active == 0


def test_the_end_of_sequence_ends_a_request_and_is_no_token(core: CoreBatch) -> None:
    eos = start_tier().tokenizer.eos_token_id
    core.add("a", FRANCE, greedy(64))
    steps = run_out(core)["a"]
    tokens = token_ids(steps)
    assert steps[-1].finish == FinishReason.STOP
    assert eos not in tokens and 0 < len(tokens) < 64
    assert tokens == library((FRANCE, greedy(64)))[0]
    # ignore_eos: it runs to max_tokens, through the end of sequence.
    core.add("b", FRANCE, greedy(len(tokens) + 4, ignore_eos=True))
    steps = run_out(core)["b"]
    assert steps[-1].finish == FinishReason.LENGTH and len(token_ids(steps)) == len(tokens) + 4


def test_a_cancelled_request_is_never_heard_of_again_and_the_other_goes_on(core: CoreBatch) -> None:
    # (Its tokens are no longer those it would have alone: the library's batched passes round
    # differently, and this small model's greedy choice flips on that.)
    core.add("a", STORY, greedy(12, ignore_eos=True))
    core.add("b", FRANCE, greedy(200, ignore_eos=True))
    seen: dict[str, list[int]] = {"a": [], "b": []}
    while len(seen["b"]) < 3:
        for step in core.steps(0.05):
            seen[step.request_id] += [t for t, _ in step.tokens]
    core.cancel("b")
    assert core.active == 1
    rest = run_out(core)
    assert set(rest) == {"a"}
    assert len(seen["a"] + token_ids(rest["a"])) == 12 and rest["a"][-1].finish == FinishReason.LENGTH


def test_a_bad_request_fails_alone(core: CoreBatch) -> None:
    core.add("good", STORY, greedy(5))
    with pytest.raises(ValueError, match="vocabulary"):
        core.add("oov", [1, 10**7], greedy(5))
    with pytest.raises(ValueError, match="no tokens"):
        core.add("empty", [], greedy(5))
    with pytest.raises(ValueError, match="KV cache"):
        core.add("long", [1] * kv_tokens(), greedy(5))
    steps = run_out(core)
    assert set(steps) == {"good"} and len(token_ids(steps["good"])) == 5


def test_a_request_joins_mid_batch_and_each_gets_its_own_tokens(core: CoreBatch) -> None:
    core.add("a", STORY, greedy(20, ignore_eos=True))
    first = core.steps(0.05) + core.steps(0.05)
    assert [s.request_id for s in first] == ["a", "a"]
    core.add("b", FRANCE, greedy(10, ignore_eos=True))
    steps = run_out(core)
    assert len([t for s in first for t, _ in s.tokens] + token_ids(steps["a"])) == 20
    assert len(token_ids(steps["b"])) == 10


def test_logprobs_of_the_chosen_token_come_with_it(core: CoreBatch) -> None:
    core.add("a", STORY, greedy(4, logprobs=0))
    pairs = [pair for step in run_out(core)["a"] for pair in step.tokens]
    assert len(pairs) == 4
    assert all(lp is not None and lp.token == t and lp.logprob <= 0.0 for t, lp in pairs)


def test_each_step_takes_a_turn_with_the_most_urgent_deadline_and_posts_the_next() -> None:
    gate = TurnLog()
    core, _ = core_batch_factory(gate)
    try:
        core.add("slow", STORY, greedy(3, ignore_eos=True), lambda n: 100.0 + n)
        core.add("urgent", STORY, greedy(3, ignore_eos=True), lambda n: 50.0 + 30.0 * n)
        run_out(core)
        # Both generate a token a step: min(100 + n, 50 + 30n) with n tokens so far; each turn
        # is left posted with the next one's deadline, the last with none.
        assert gate.entered == [50.0, 80.0, 102.0]
        assert gate.left == [80.0, 102.0, math.inf]
    finally:
        core.close()

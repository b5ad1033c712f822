"""The start tier as a `Batch` (`batch.StartBatch`) on the real default model: a batch of one
samples as a single sequence does, padded and joined rows decode as they would alone, ends of
sequence and max_tokens, cancels, bad requests and failed passes failing alone, the logits'
requests (logit_bias, top_logprobs), the turn each pass takes, and handing requests over."""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np
import pytest

from services.engine.batch import StartBatch
from services.engine.sampling import Sampler, token_logprob
from shared.messages import FinishReason, SamplingParams, TokenLogprob
from tests.conformance.ovbatches import TurnLog, encode, kv_tokens, run_out, start_batch_factory, start_tier, token_ids

FRANCE = encode("The capital of France is")
PROMPTS = [[1, 9690, 198, 2683, 359, 253, 5356, 11173, 30], [1, 4093, 1115, 2], list(range(100, 140))]
"""Of different lengths: the shorter ones are left-padded (a wrong mask or position would
change their tokens from the first one on)."""


def greedy(max_tokens: int, **kw: object) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)  # type: ignore[arg-type]


def single(prompt: list[int], params: SamplingParams) -> list[tuple[int, TokenLogprob | None]]:
    """One sequence decoded alone on the stateful model with the tier's sampler: what the start
    tier did for a request before it was a batch."""
    loaded = start_tier()
    request = loaded.compiled.create_infer_request()
    sampler = Sampler.of(params)
    context = list(prompt)
    out: list[tuple[int, TokenLogprob | None]] = []
    request.reset_state()
    n = len(prompt)
    inputs = {
        "input_ids": np.asarray([prompt], dtype=np.int64),
        "attention_mask": np.ones((1, n), dtype=np.int64),
        "position_ids": np.arange(n, dtype=np.int64)[None],
        "beam_idx": np.zeros(1, dtype=np.int32),
    }
    while True:
        request.infer(inputs)
        logits = request.get_tensor("logits").data[0, -1]
        token = sampler.pick(logits, context)
        if token in loaded.eos_ids and not params.ignore_eos:
            return out
        assert sampler.adjusted is not None
        out.append((token, token_logprob(sampler.adjusted, token, params.logprobs) if params.logprobs >= 0 else None))
        context.append(token)
        if len(out) == params.max_tokens:
            return out
        inputs = {
            "input_ids": np.asarray([[token]], dtype=np.int64),
            "attention_mask": np.ones((1, len(context)), dtype=np.int64),
            "position_ids": np.asarray([[len(context) - 1]], dtype=np.int64),
            "beam_idx": np.zeros(1, dtype=np.int32),
        }


@pytest.fixture
def batch() -> Iterator[StartBatch]:
    b, _ = start_batch_factory()
    yield b
    b.close()


def pairs(steps: list) -> list[tuple[int, TokenLogprob | None]]:
    return [pair for step in steps for pair in step.tokens]


def test_a_batch_of_one_samples_as_a_single_sequence_does(batch: StartBatch) -> None:
    for params in (
        SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=7, repetition_penalty=1.2, logprobs=2),
        SamplingParams(max_tokens=12, temperature=1.0, seed=3, frequency_penalty=0.5, presence_penalty=0.3, top_k=20),
        SamplingParams(max_tokens=8, temperature=0.0, logit_bias=((198, 5.0),), logprobs=0),
    ):
        batch.add("a", PROMPTS[0], params)
        assert pairs(run_out(batch)["a"]) == single(PROMPTS[0], params)


def test_padded_rows_decode_as_they_would_alone_and_joined_rows_too(batch: StartBatch) -> None:
    max_tokens = [8, 3, 8]  # the middle row leaves the batch early
    alone = [[t for t, _ in single(p, greedy(m))] for p, m in zip(PROMPTS, max_tokens, strict=True)]
    for i, (p, m) in enumerate(zip(PROMPTS, max_tokens, strict=True)):
        batch.add(f"r{i}", p, greedy(m))
    together = run_out(batch)
    assert [token_ids(together[f"r{i}"]) for i in range(3)] == alone
    longest = max(len(p) for p in PROMPTS)
    assert all(step.prefill_tokens == 3 * longest for s in together.values() for step in s)
    # Joining a running batch re-prefills its rows with their output so far: the running rows
    # go on with the tokens they would have had, the newcomers get theirs.
    batch.add("r0", PROMPTS[0], greedy(8))
    seen = {"r0": token_ids(batch.steps(0.0))}
    batch.add("r1", PROMPTS[1], greedy(3))
    second = batch.steps(0.0)
    assert [s.request_id for s in second] == ["r0"]  # arriving: it waits a step
    seen["r0"] += token_ids(second)
    batch.add("r2", PROMPTS[2], greedy(8))  # arrived meanwhile: it waits a step more, then both join
    for _ in range(3):
        for step in batch.steps(0.0):
            seen.setdefault(step.request_id, []).extend(t for t, _ in step.tokens)
    assert set(seen) == {"r0", "r1", "r2"}
    for rid, steps in run_out(batch).items():
        seen[rid] += token_ids(steps)
    assert [seen[f"r{i}"] for i in range(3)] == alone


def test_the_end_of_sequence_ends_a_row_and_is_no_token(batch: StartBatch) -> None:
    params = SamplingParams(max_tokens=64, temperature=0.0)
    batch.add("a", FRANCE, params)
    steps = run_out(batch)["a"]
    assert steps[-1].finish == FinishReason.STOP and steps[-1].tokens == ()
    assert token_ids(steps) == [t for t, _ in single(FRANCE, params)]
    assert 0 < len(token_ids(steps)) < 64 and not set(token_ids(steps)) & start_tier().eos_ids


def test_max_tokens_ends_a_row_with_its_last_token(batch: StartBatch) -> None:
    batch.add("a", FRANCE, greedy(5))
    steps = run_out(batch)["a"]
    assert len(steps) == 5 and steps[-1].finish == FinishReason.LENGTH and len(steps[-1].tokens) == 1


def test_a_cancelled_row_leaves_after_its_token_and_the_others_stay_whole(batch: StartBatch) -> None:
    alone = [t for t, _ in single(PROMPTS[0], greedy(10))]
    batch.add("a", PROMPTS[0], greedy(10))
    batch.add("b", PROMPTS[2], greedy(200))
    batch.add("c", PROMPTS[1], greedy(5))
    first = batch.steps(0.0)
    assert {s.request_id for s in first} == {"a", "b", "c"}
    batch.cancel("b")
    batch.cancel("c")
    assert batch.active == 1
    rest = run_out(batch)
    assert set(rest) == {"a"}
    assert [t for s in first if s.request_id == "a" for t, _ in s.tokens] + token_ids(rest["a"]) == alone
    # A queued request cancelled never runs.
    batch.add("d", PROMPTS[0], greedy(3))
    batch.add("e", PROMPTS[1], greedy(3))
    batch.cancel("e")
    assert set(run_out(batch)) == {"d"}


def test_a_bad_request_fails_alone(batch: StartBatch) -> None:
    batch.add("good", PROMPTS[0], greedy(4))
    with pytest.raises(ValueError, match="vocabulary"):
        batch.add("oov", [1, 49152], greedy(4))
    with pytest.raises(ValueError, match="no tokens"):
        batch.add("empty", [], greedy(4))
    with pytest.raises(ValueError, match="KV cache"):
        batch.add("long", [1] * kv_tokens(), greedy(4))
    assert len(token_ids(run_out(batch)["good"])) == 4


def test_a_failed_pass_fails_its_batch_and_the_next_batch_runs(
    batch: StartBatch, monkeypatch: pytest.MonkeyPatch
) -> None:
    class FailingRequest:
        """Stands in for an infer request whose pass fails (a runtime error cannot be made on
        purpose with the real model)."""

        def reset_state(self) -> None:
            pass

        def infer(self, inputs: object) -> None:
            raise RuntimeError("the runtime failed")

    real = batch._request_for
    monkeypatch.setattr(batch, "_request_for", lambda rows: FailingRequest())
    batch.add("a", PROMPTS[0], greedy(4))
    batch.add("b", PROMPTS[1], greedy(4))
    failed = batch.steps(0.0)
    assert {s.request_id for s in failed} == {"a", "b"}
    assert all("the runtime failed" in s.error for s in failed) and batch.active == 0 and batch.alive
    monkeypatch.setattr(batch, "_request_for", real)
    batch.add("c", PROMPTS[0], greedy(4))
    assert len(token_ids(run_out(batch)["c"])) == 4


def test_logit_bias_and_top_logprobs_are_read_from_the_logits(batch: StartBatch) -> None:
    forced = 504
    batch.add("biased", PROMPTS[0], greedy(4, logit_bias=((forced, 100.0),)))
    batch.add("top", PROMPTS[1], greedy(4, logprobs=3))
    steps = run_out(batch)
    assert token_ids(steps["biased"]) == [forced] * 4
    for token, lp in pairs(steps["top"]):
        assert lp is not None and len(lp.top) == 3 and lp.top[0][0] == token == lp.token


def test_each_pass_takes_a_turn_with_the_most_urgent_deadline_and_posts_the_next() -> None:
    gate = TurnLog()
    batch, _ = start_batch_factory(gate)
    batch.add("slow", PROMPTS[0], greedy(3), lambda n: 100.0 + n)
    batch.add("urgent", PROMPTS[1], greedy(2), lambda n: 50.0 + 30.0 * n)
    run_out(batch)
    # The prefill for both at 0 tokens; then min(100 + n, 50 + 30n); "urgent" is done after 2.
    # Each turn is left posted with the next one's deadline, the last with none.
    assert gate.entered == [50.0, 80.0, 102.0]
    assert gate.left == [80.0, 102.0, math.inf]


def test_hand_over_takes_the_rest_of_a_running_request_and_keeps_the_others(batch: StartBatch) -> None:
    batch.add("a", PROMPTS[0], greedy(10), lambda n: 10.0 + n)
    batch.add("keep", PROMPTS[1], greedy(10, logprobs=2))
    made = [t for _ in range(3) for s in batch.steps(0.0) if s.request_id == "a" for t, _ in s.tokens]
    batch.add("queued", PROMPTS[2], greedy(6))
    moved = batch.hand_over(lambda p: p.logprobs > 0)  # the logits' requests stay
    assert [m.request_id for m in moved] == ["queued", "a"]
    queued, a = moved
    assert queued.prompt_ids == tuple(PROMPTS[2])
    # "a" goes on from its next token: its context so far, what it may still make, its
    # deadline counted on from the 3 tokens it made.
    assert a.prompt_ids == (*PROMPTS[0], *made) and len(made) == 3
    assert a.params.max_tokens == 7 and a.deadline(0) == 13.0
    rest = run_out(batch)
    assert set(rest) == {"keep"} and batch.active == 0


def test_release_lets_the_idle_infer_request_go(batch: StartBatch) -> None:
    batch.add("a", PROMPTS[0], greedy(3))
    batch.steps(0.0)
    assert not batch.release()  # a batch runs on it
    run_out(batch)
    assert batch.release() and not batch.release()
    batch.add("b", PROMPTS[0], greedy(3))
    assert len(token_ids(run_out(batch)["b"])) == 3

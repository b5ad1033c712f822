"""The continuous-batching core's pure part: the library config a request's parameters make,
and the prompts no batch takes."""

from __future__ import annotations

import pytest

from services.engine.core import check_prompt, generation_config, needs_core
from shared.messages import SamplingParams


def test_greedy_parameters_make_a_greedy_config_without_the_librarys_stop_strings() -> None:
    # Stop strings are matched once, in the worker's loop, for every backend.
    c = generation_config(SamplingParams(max_tokens=7, temperature=0.0, stop=("END", "")), eos_token_id=2)
    assert c.max_new_tokens == 7
    assert not c.do_sample
    assert not c.stop_strings
    assert c.eos_token_id == 2
    c.validate()


def test_sampling_parameters_carry_over_with_the_seed() -> None:
    p = SamplingParams(max_tokens=5, temperature=0.7, top_p=0.9, seed=42, repetition_penalty=1.2, ignore_eos=True)
    c = generation_config(p, eos_token_id=2)
    assert c.do_sample
    assert abs(c.temperature - 0.7) < 1e-6 and abs(c.top_p - 0.9) < 1e-6
    assert c.rng_seed == 42
    assert abs(c.repetition_penalty - 1.2) < 1e-6
    assert c.ignore_eos


def test_unseeded_requests_get_different_random_streams() -> None:
    # The library would start every unseeded request at the same default seed.
    seeds = {generation_config(SamplingParams(max_tokens=1, temperature=1.0), 2).rng_seed for _ in range(8)}
    assert len(seeds) > 1


def test_parameters_below_float32_range_still_make_a_valid_config() -> None:
    # The library stores them as float32 and refuses 0: 5e-324 must not become a 503. A
    # temperature that small is greedy (`sampling.is_greedy`, every engine alike).
    tiny = 5e-324
    nearly = generation_config(SamplingParams(max_tokens=1, temperature=tiny, repetition_penalty=tiny), 2)
    assert not nearly.do_sample
    nearly.validate()
    assert not generation_config(SamplingParams(max_tokens=1, temperature=0.0), 2).do_sample
    sampled = generation_config(SamplingParams(max_tokens=1, temperature=1.0, top_p=tiny), 2)
    assert sampled.do_sample
    sampled.validate()


def test_penalties_top_k_and_min_p_carry_over() -> None:
    p = SamplingParams(
        max_tokens=5, temperature=0.7, frequency_penalty=0.5, presence_penalty=-0.25, top_k=40, min_p=0.05
    )
    c = generation_config(p, eos_token_id=2)
    assert abs(c.frequency_penalty - 0.5) < 1e-6 and abs(c.presence_penalty + 0.25) < 1e-6
    assert c.top_k == 40 and abs(c.min_p - 0.05) < 1e-6
    c.validate()
    unlimited = generation_config(SamplingParams(max_tokens=5, temperature=0.7), eos_token_id=2)
    assert unlimited.top_k > 2**32  # the library's "every token"


def test_what_the_start_tier_cannot_sample_waits_for_the_core() -> None:
    assert not needs_core(SamplingParams(max_tokens=5, temperature=0.7, repetition_penalty=1.3))
    for p in (
        SamplingParams(max_tokens=5, seed=1),
        SamplingParams(max_tokens=5, frequency_penalty=0.1),
        SamplingParams(max_tokens=5, presence_penalty=-0.1),
        SamplingParams(max_tokens=5, top_k=1),
        SamplingParams(max_tokens=5, min_p=0.1),
    ):
        assert needs_core(p), p


def test_a_request_no_forward_pass_can_take_is_refused() -> None:
    check_prompt([0, 5, 9], max_tokens=7, vocab_size=10, kv_tokens=10)
    with pytest.raises(ValueError, match="no tokens"):
        check_prompt([], max_tokens=1, vocab_size=10, kv_tokens=10)
    with pytest.raises(ValueError, match="token id 10 is outside"):
        check_prompt([1, 10], max_tokens=1, vocab_size=10, kv_tokens=10)
    with pytest.raises(ValueError, match="token id -1"):
        check_prompt([-1], max_tokens=1, vocab_size=10, kv_tokens=10)
    with pytest.raises(ValueError, match=r"the prompt \(3 tokens\) and max_tokens \(8\) exceed .* KV cache of 10"):
        check_prompt([0, 5, 9], max_tokens=8, vocab_size=10, kv_tokens=10)

"""The mapping of a request's settings to vLLM's (`vllm_engine/params.py`): pure, so it is
tested here, where vLLM is not installed; `tests/e2e/test_vllm_backend.py` runs vLLM itself."""

from __future__ import annotations

import pytest

from services.engine.vllm_engine.params import LORA_RANKS, kv_cache_bytes, lora_rank, sampling_kwargs, structured_kwargs
from shared.messages import Guide, SamplingParams


def test_every_setting_a_client_sends_reaches_vllm() -> None:
    p = SamplingParams(
        max_tokens=20,
        temperature=0.7,
        top_p=0.9,
        seed=5,
        stop=("\n\n",),
        repetition_penalty=1.1,
        frequency_penalty=0.5,
        presence_penalty=0.25,
        top_k=40,
        min_p=0.05,
        logprobs=3,
        logit_bias=((11, -100.0), (12, 5.0)),
    )
    kw = sampling_kwargs(p, [2, 7])
    assert kw == {
        "n": 1,
        "max_tokens": 20,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 40,
        "min_p": 0.05,
        "seed": 5,
        "repetition_penalty": 1.1,
        "frequency_penalty": 0.5,
        "presence_penalty": 0.25,
        "logit_bias": {11: -100.0, 12: 5.0},
        "ignore_eos": False,
        "stop_token_ids": [2, 7],
        "logprobs": 3,
        "detokenize": False,
    }


def test_defaults_ask_vllm_for_nothing_extra() -> None:
    kw = sampling_kwargs(SamplingParams(max_tokens=4, ignore_eos=True), [2])
    assert kw["logprobs"] is None and kw["logit_bias"] is None and kw["top_k"] == 0 and kw["seed"] is None
    assert kw["stop_token_ids"] == [] and kw["ignore_eos"] is True  # an ignored end is no stop either
    assert sampling_kwargs(SamplingParams(max_tokens=4, logprobs=0), [2])["logprobs"] == 0


def test_each_guide_kind_becomes_its_structured_output_field() -> None:
    assert structured_kwargs(Guide("json_schema", '{"type": "object"}')) == {"json": '{"type": "object"}'}
    assert structured_kwargs(Guide("regex", "[0-9]+")) == {"regex": "[0-9]+"}
    assert structured_kwargs(Guide("grammar", 'root ::= "yes"')) == {"grammar": 'root ::= "yes"'}
    with pytest.raises(ValueError, match="unknown structured-output kind 'xml'"):
        structured_kwargs(Guide("xml", "<a/>"))


def test_the_cache_holds_keys_and_values_of_every_layers_kv_heads() -> None:
    # SmolLM2-135M: 30 layers, 9 heads of 64 (hidden 576), 3 KV heads; bf16.
    smol = {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 576}
    assert kv_cache_bytes(smol, 1, 2) == 2 * 30 * 3 * 64 * 2
    assert kv_cache_bytes({**smol, "head_dim": 128}, 10, 4) == 2 * 30 * 3 * 128 * 4 * 10
    assert kv_cache_bytes({k: v for k, v in smol.items() if k != "num_key_value_heads"}, 1, 2) == 2 * 30 * 9 * 64 * 2


def test_a_lora_able_engine_takes_the_smallest_rank_vllm_accepts_that_fits_every_kept_adapter() -> None:
    assert lora_rank([]) == 0  # nothing kept: LoRA off
    assert lora_rank([4, 8]) == 8
    assert lora_rank([9]) == 16
    assert lora_rank([300]) == 320
    with pytest.raises(ValueError, match="rank 600"):
        lora_rank([600])
    assert list(LORA_RANKS) == sorted(LORA_RANKS)

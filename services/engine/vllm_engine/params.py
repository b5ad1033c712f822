"""A request's settings as vLLM's: `SamplingParams` arguments, structured output, and the
engine's cache size. Pure (no vLLM import), so the mapping is tested where vLLM is absent."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from shared.messages import Guide, SamplingParams

STRUCTURED_KEYS = {"json_schema": "json", "regex": "regex", "grammar": "grammar"}
"""Our guide kinds and vLLM's `StructuredOutputsParams` field for each (a `grammar` is xgrammar's
EBNF, which vLLM's default backend compiles with xgrammar, as the OpenVINO engine does)."""


LORA_RANKS = (8, 16, 32, 64, 128, 256, 320, 512)
"""The `max_lora_rank` values vLLM accepts."""
MAX_LORAS = 8
"""Adapters one vLLM step applies at most (each row its own)."""


def lora_rank(ranks: Sequence[int]) -> int:
    """The `max_lora_rank` an engine needs for adapters of these ranks (0: none, LoRA off)."""
    need = max(ranks, default=0)
    if need == 0:
        return 0
    fit = [r for r in LORA_RANKS if r >= need]
    if not fit:
        raise ValueError(f"a LoRA adapter of rank {need} is past vLLM's largest ({LORA_RANKS[-1]})")
    return fit[0]


def structured_kwargs(guide: Guide) -> dict[str, str]:
    key = STRUCTURED_KEYS.get(guide.kind)
    if key is None:
        raise ValueError(f"unknown structured-output kind {guide.kind!r} (one of {sorted(STRUCTURED_KEYS)})")
    return {key: guide.spec}


def sampling_kwargs(p: SamplingParams, ends: Sequence[int]) -> dict[str, Any]:
    """vLLM `SamplingParams` arguments for `p`, less its own classes' (`batch.py` adds them);
    `ends`: the model's ends of sequence (a chat's end of turn too). No stop strings and no
    detokenizing: the worker loop's text does both, as for every engine. Logprobs are vLLM's
    default: the model's, before any processing."""
    return {
        "n": 1,
        "max_tokens": p.max_tokens,
        "temperature": p.temperature,
        "top_p": p.top_p,
        "top_k": max(0, p.top_k),  # 0: every token, in both
        "min_p": p.min_p,
        "seed": p.seed,
        "repetition_penalty": p.repetition_penalty,
        "frequency_penalty": p.frequency_penalty,
        "presence_penalty": p.presence_penalty,
        "logit_bias": {token: bias for token, bias in p.logit_bias} or None,
        "ignore_eos": p.ignore_eos,
        "stop_token_ids": [] if p.ignore_eos else list(ends),
        "logprobs": p.logprobs if p.logprobs >= 0 else None,
        "detokenize": False,
    }


def kv_cache_bytes(config: Mapping[str, Any], tokens: int, dtype_bytes: int) -> int:
    """Bytes of a KV cache that holds `tokens` tokens of a decoder with `config` (its
    `config.json`): keys and values of every layer's KV heads."""
    heads = int(config.get("num_key_value_heads") or config["num_attention_heads"])
    head_dim = int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])
    return 2 * int(config["num_hidden_layers"]) * heads * head_dim * dtype_bytes * tokens

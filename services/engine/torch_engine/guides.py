"""Structured output on the torch engine, enforced token by token by llguidance (vLLM's `guidance`
backend, llama.cpp's): `json_schema`, `regex`, and `grammar` (xgrammar's EBNF, as the OpenVINO
engine takes it, turned into Lark); and `Row`, one request's picks on the host."""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import llguidance
import llguidance.hf
import llguidance.numpy
import numpy as np
import numpy.typing as npt
from llguidance.gbnf_to_lark import any_to_lark

from services.engine.sampling import Sampler, token_logprob
from shared.messages import FinishReason, Guide, SamplingParams, TokenLogprob


class GuideError(ValueError):
    """A spec that slipped past the gateway's check and does not compile: that request fails."""


@dataclass
class Guides:
    """Compiles guides against one model's tokenizer (converted, ≈ 0.5 s, at the first one)."""

    tokenizer: Any
    vocab_size: int
    eos_ids: Iterable[int]

    @cached_property
    def _ll(self) -> llguidance.LLTokenizer:
        return llguidance.hf.from_tokenizer(self.tokenizer, n_vocab=self.vocab_size, eos_token=sorted(self.eos_ids))

    def start(self, guide: Guide | None) -> llguidance.LLMatcher | None:
        if guide is None:
            return None
        if guide.kind == "json_schema":
            grammar = llguidance.LLMatcher.grammar_from_json_schema(guide.spec)
        elif guide.kind == "regex":
            grammar = llguidance.LLMatcher.grammar_from_regex(guide.spec)
        elif guide.kind == "grammar":
            try:
                grammar = llguidance.LLMatcher.grammar_from_lark(any_to_lark(guide.spec))
            except Exception as e:  # the converter's own parse errors
                raise GuideError(f"grammar: {e}") from e
        else:
            raise GuideError(f"unknown guide kind {guide.kind!r}")
        matcher = llguidance.LLMatcher(self._ll, grammar)
        if matcher.is_error():
            raise GuideError(f"{guide.kind}: {matcher.get_error()}")
        return matcher


@dataclass
class Row:
    """One request's tokens picked on the host (a batch's host row, a pipeline's request and the
    one-request path alike, so a seed gives one token on each): masked by its grammar, with its
    logprob where asked; an end of sequence or `max_tokens` ends it."""

    params: SamplingParams
    context: list[int]
    """Its prompt and tokens (what the repetition penalty reads)."""
    eos_ids: Collection[int]
    guide: llguidance.LLMatcher | None = None
    logprobs: list[TokenLogprob | None] = field(default_factory=list)
    """One per token."""
    finish: FinishReason | None = None

    def __post_init__(self) -> None:
        self.sampler = Sampler.of(self.params)

    def pick(self, logits: npt.NDArray[np.float32]) -> int:
        if self.guide is not None:  # -inf where the grammar allows no token (complete: all but an end of sequence)
            mask = llguidance.numpy.allocate_token_bitmask(1, logits.size)
            llguidance.numpy.fill_next_token_bitmask(self.guide, mask, 0)
            logits = np.array(logits, dtype=np.float32, copy=True)
            llguidance.numpy.apply_token_bitmask_inplace(logits, mask)
        token = self.sampler.pick(logits, self.context)
        if self.guide is not None and not self.guide.consume_token(token):
            raise GuideError(f"the grammar refused token {token}: {self.guide.get_error()}")
        top, adjusted = self.params.logprobs, self.sampler.adjusted
        self.took(token, None if top < 0 or adjusted is None else token_logprob(adjusted, token, top))
        return token

    def took(self, token: int, logprob: TokenLogprob | None = None) -> None:
        self.context.append(token)
        self.logprobs.append(logprob)
        if token in self.eos_ids and not self.params.ignore_eos:
            self.finish = FinishReason.STOP
        elif len(self.logprobs) >= self.params.max_tokens:
            self.finish = FinishReason.LENGTH

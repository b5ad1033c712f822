"""Structured output on the torch engine, enforced token by token by llguidance (vLLM's `guidance`
backend, llama.cpp's): `json_schema`, `regex`, and `grammar` (xgrammar's EBNF, which the OpenVINO
engine takes, turned into Lark by llguidance's converter); and the host's pick of one token."""

from __future__ import annotations

from collections.abc import Iterable
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


class Guided:
    """One request's grammar state: it masks each row before the pick and consumes the pick."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int) -> None:
        self.matcher = matcher
        self.bitmask = llguidance.numpy.allocate_token_bitmask(1, vocab_size)

    def mask(self, logits: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
        """A copy of the row, -inf wherever the grammar allows no token (once it is complete it
        allows only an end of sequence)."""
        llguidance.numpy.fill_next_token_bitmask(self.matcher, self.bitmask, 0)
        row = np.array(logits, dtype=np.float32, copy=True)
        llguidance.numpy.apply_token_bitmask_inplace(row, self.bitmask)
        return row

    def accept(self, token: int) -> None:
        if not self.matcher.consume_token(token):
            raise GuideError(f"the grammar refused token {token}: {self.matcher.get_error()}")


class Guides:
    """Compiles guides against one model's tokenizer (converted, ≈ 0.5 s, at the first one)."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_ids: Iterable[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_ids = sorted(eos_ids)

    @cached_property
    def _ll(self) -> llguidance.LLTokenizer:
        return llguidance.hf.from_tokenizer(self.tokenizer, n_vocab=self.vocab_size, eos_token=self.eos_ids)

    def start(self, guide: Guide) -> Guided:
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
        return Guided(matcher, self.vocab_size)


@dataclass
class Row:
    """One request's tokens picked on the host (a batch's host row, a pipeline's request and the
    one-request path alike, so a seed gives one token on each): masked by its grammar, with its
    logprob where asked; an end of sequence or `max_tokens` ends it."""

    params: SamplingParams
    context: list[int]
    """Its prompt and tokens (what the repetition penalty reads)."""
    eos_ids: frozenset[int]
    guided: Guided | None = None
    logprobs: list[TokenLogprob | None] = field(default_factory=list)
    """One per token."""
    finish: FinishReason | None = None

    def __post_init__(self) -> None:
        self.sampler = Sampler.of(self.params)

    def pick(self, logits: npt.NDArray[np.float32]) -> int:
        token = self.sampler.pick(logits if self.guided is None else self.guided.mask(logits), self.context)
        if self.guided is not None:
            self.guided.accept(token)
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

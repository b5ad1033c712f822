"""Structured output on the torch engine: the request's `Guide` enforced token by token by
llguidance (the grammar engine behind vLLM's `guidance` backend and llama.cpp's), the same
kinds the OpenVINO engine enforces with xgrammar: `json_schema`, `regex`, and `grammar`
(xgrammar's EBNF, GBNF's dialect, turned into Lark by llguidance's own converter).

Before each pick the grammar's allowed tokens mask the row's logits (everything else -inf);
the engine's sampler then picks as usual, and the grammar consumes the pick. Once the grammar
is complete it allows only an end of sequence, which ends the request.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import llguidance
import llguidance.hf
import llguidance.numpy
import numpy as np
import numpy.typing as npt
from llguidance.gbnf_to_lark import any_to_lark

from shared.messages import Guide


class GuideError(ValueError):
    """The guide's spec does not compile (the gateway checks specs first; this names what
    slipped through, for that request alone)."""


class Guided:
    """One request's grammar state."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int) -> None:
        self.matcher = matcher
        self.bitmask = llguidance.numpy.allocate_token_bitmask(1, vocab_size)

    def mask(self, logits: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
        """The row with every token the grammar does not allow next at -inf (a copy)."""
        llguidance.numpy.fill_next_token_bitmask(self.matcher, self.bitmask, 0)
        row = np.array(logits, dtype=np.float32, copy=True)
        llguidance.numpy.apply_token_bitmask_inplace(row, self.bitmask)
        return row

    def accept(self, token: int) -> None:
        if not self.matcher.consume_token(token):
            raise GuideError(f"the grammar refused token {token}: {self.matcher.get_error()}")


class Guides:
    """Compiles guides against one model's tokenizer (its conversion, ≈ 0.5 s here, is made
    at the first guided request and kept)."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_ids: Iterable[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_ids = sorted(eos_ids)
        self._ll: llguidance.LLTokenizer | None = None

    def _tokenizer(self) -> llguidance.LLTokenizer:
        if self._ll is None:
            self._ll = llguidance.hf.from_tokenizer(self.tokenizer, n_vocab=self.vocab_size, eos_token=self.eos_ids)
        return self._ll

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
        matcher = llguidance.LLMatcher(self._tokenizer(), grammar)
        if matcher.is_error():
            raise GuideError(f"{guide.kind}: {matcher.get_error()}")
        return Guided(matcher, self.vocab_size)

"""Choosing the next token from logits on the stateful tier: penalties, logit_bias, then
greedy or temperature + top-k + nucleus (top-p) + min-p sampling; and the logprobs that a
request asked for, read from the same logits.

The continuous-batching core samples with the library's own sampler; this one serves the
start tier and the requests that need the logits (`core.needs_logits`: logit_bias and
top_logprobs, which the pipeline does not expose). Pure and seeded, so that the same seed
gives the same sample (OpenAI's `seed`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Protocol

import numpy as np
import numpy.typing as npt

from shared.messages import SamplingParams, TokenLogprob

SAMPLING_EPS = 1e-5
"""A temperature below this samples greedily (vLLM's `_SAMPLING_EPS`): dividing logits by a
smaller one overflows, and a sample at it is the most likely token anyway."""


class _Tempered(Protocol):
    @property
    def temperature(self) -> float: ...


def is_greedy(p: _Tempered) -> bool:
    """Whether a request (its `SamplingParams`, a `Sampler`, a row of the device sampler)
    takes the most likely token: decided here alone, for every engine."""
    return p.temperature < SAMPLING_EPS


class Sampler:
    def __init__(
        self,
        temperature: float,
        top_p: float,
        seed: int | None,
        repetition_penalty: float = 1.0,
        frequency_penalty: float = 0.0,
        presence_penalty: float = 0.0,
        top_k: int = 0,
        min_p: float = 0.0,
        logit_bias: Sequence[tuple[int, float]] = (),
    ) -> None:
        self.temperature = temperature
        self.top_p = top_p
        self.rng = np.random.default_rng(seed)
        self.repetition_penalty = repetition_penalty
        self.frequency_penalty = frequency_penalty
        self.presence_penalty = presence_penalty
        self.top_k = top_k
        self.min_p = min_p
        self.bias_ids = np.asarray([t for t, _ in logit_bias], dtype=np.int64)
        self.bias = np.asarray([b for _, b in logit_bias], dtype=np.float32)
        self.adjusted: npt.NDArray[np.float32] | None = None
        """The last pick's logits after penalties and bias (what its logprobs are read from)."""
        self.generated: Counter[int] = Counter()
        """Tokens this sampler picked (what frequency and presence penalties count, as
        OpenAI and OpenVINO GenAI count them: the completion's, not the prompt's)."""

    @classmethod
    def of(cls, p: SamplingParams) -> Sampler:
        return cls(
            p.temperature,
            p.top_p,
            p.seed,
            p.repetition_penalty,
            p.frequency_penalty,
            p.presence_penalty,
            p.top_k,
            p.min_p,
            p.logit_bias,
        )

    @property
    def greedy(self) -> bool:
        return is_greedy(self)

    def _adjusted(self, logits: npt.NDArray[np.float32], context: list[int] | None) -> npt.NDArray[np.float32]:
        logits = logits.copy()
        if self.repetition_penalty != 1.0 and context:
            # CTRL's penalty, as OpenVINO GenAI and HF apply it: every token already in the
            # context is made less likely (its logit divided if positive, multiplied if not).
            seen = np.unique(np.asarray(context, dtype=np.int64))
            picked = logits[seen]
            logits[seen] = np.where(picked > 0, picked / self.repetition_penalty, picked * self.repetition_penalty)
        if self.generated and (self.frequency_penalty or self.presence_penalty):
            ids = np.fromiter(self.generated.keys(), dtype=np.int64)
            counts = np.fromiter(self.generated.values(), dtype=np.float32)
            logits[ids] -= self.frequency_penalty * counts + self.presence_penalty
        if self.bias_ids.size:
            logits[self.bias_ids] += self.bias
        return logits

    def pick(self, logits: npt.NDArray[np.float32], context: list[int] | None = None) -> int:
        self.adjusted = self._adjusted(logits, context)
        token = self._pick(self.adjusted)
        self.generated[token] += 1
        return token

    def _pick(self, logits: npt.NDArray[np.float32]) -> int:
        if self.greedy:
            return int(np.argmax(logits))
        z = logits.astype(np.float64) / self.temperature
        if 0 < self.top_k < z.size:
            kth = np.partition(z, -self.top_k)[-self.top_k]
            z[z < kth] = -np.inf
        z -= z.max()
        p = np.exp(z)
        p /= p.sum()
        if self.min_p > 0.0:
            p[p < self.min_p * p.max()] = 0.0
            p /= p.sum()
        if self.top_p < 1.0:
            # Most likely first; equal probabilities in vocabulary order (a stable sort), so
            # that the batch's device sampler (`torch_engine/row_sampling.py`) orders them alike.
            order = np.argsort(-p, kind="stable")
            cumulative = np.cumsum(p[order])
            # Smallest prefix whose mass reaches top_p (always at least the top token).
            keep = order[: int(np.searchsorted(cumulative, self.top_p)) + 1]
            return int(keep[self._inverse_cdf(p[keep] / p[keep].sum())])
        return self._inverse_cdf(p)

    def uniform(self) -> float:
        """The one draw of this request's generator that a sampled token consumes."""
        return float(self.rng.random())

    def _inverse_cdf(self, p: npt.NDArray[np.float64]) -> int:
        # What `Generator.choice(len(p), p=p)` computes, spelled out, so that a sampler that
        # picks on the device from the same draw (`uniform`) picks the same token.
        cdf = np.cumsum(p)
        cdf /= cdf[-1]
        return int(cdf.searchsorted(self.uniform(), side="right"))

    @property
    def plain(self) -> bool:
        """No penalty or bias: the token depends on the logits and the draw alone."""
        return (
            self.repetition_penalty == 1.0
            and not self.frequency_penalty
            and not self.presence_penalty
            and not self.bias_ids.size
        )

    def record(self, token: int) -> None:
        """A token picked for this request elsewhere (from its draw), counted as its own."""
        self.generated[token] += 1


def token_logprob(logits: npt.NDArray[np.float32], token: int, top: int) -> TokenLogprob:
    """`token`'s log-probability and the `top` most likely tokens', from the logits it was
    chosen from: after penalties and logit_bias, before temperature (vLLM's
    `processed_logprobs`), so that under greedy decoding the most likely token is the one
    chosen, and a banned token shows as unlikely as it was made."""
    z = logits.astype(np.float64)
    z -= z.max()
    log_norm = np.log(np.exp(z).sum())
    alternatives: tuple[tuple[int, float], ...] = ()
    if top > 0:
        # Equal logits in vocabulary order, as greedy decoding's argmax takes them (logits of
        # a low-precision model tie often): every token tied with the k-th is a candidate.
        kth = np.partition(z, z.size - min(top, z.size))[z.size - min(top, z.size)]
        ids = np.flatnonzero(z >= kth)
        ids = ids[np.lexsort((ids, -z[ids]))][:top]
        alternatives = tuple((int(i), float(z[i] - log_norm)) for i in ids)
    return TokenLogprob(token=token, logprob=float(z[token] - log_norm), top=alternatives)

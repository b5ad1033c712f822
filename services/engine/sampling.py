"""The next token from logits, where the engine samples itself (the start tier, torch):
penalties, logit_bias, then greedy or temperature + top-k + top-p + min-p; and the logprobs
read from the same logits. Pure and seeded: one seed, one sample (OpenAI's `seed`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
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
    """Whether a request takes the most likely token: decided here alone, for every engine."""
    return p.temperature < SAMPLING_EPS


@dataclass
class Sampler:
    temperature: float
    top_p: float
    seed: int | None
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    top_k: int = 0
    min_p: float = 0.0
    logit_bias: Sequence[tuple[int, float]] = ()
    adjusted: npt.NDArray[np.float32] | None = field(default=None, init=False)
    """The last pick's logits after penalties and bias (what its logprobs are read from)."""
    generated: Counter[int] = field(default_factory=Counter, init=False)
    """Tokens it picked: what frequency and presence penalties count (the completion's only,
    as OpenAI and OpenVINO GenAI count them)."""

    def __post_init__(self) -> None:
        self.rng = np.random.default_rng(self.seed)
        self.bias_ids = np.asarray([t for t, _ in self.logit_bias], dtype=np.int64)
        self.bias = np.asarray([b for _, b in self.logit_bias], dtype=np.float32)

    @classmethod
    def of(cls, p: SamplingParams) -> Sampler:
        return cls(*(getattr(p, f.name) for f in fields(cls) if f.init))

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
        if is_greedy(self):
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
            # Equal probabilities in vocabulary order, as the device sampler orders them.
            order = np.argsort(-p, kind="stable")
            cumulative = np.cumsum(p[order])
            # Smallest prefix whose mass reaches top_p (always at least the top token).
            keep = order[: int(np.searchsorted(cumulative, self.top_p)) + 1]
            return int(keep[self._inverse_cdf(p[keep] / p[keep].sum())])
        return self._inverse_cdf(p)

    def uniform(self) -> float:
        return float(self.rng.random())

    def _inverse_cdf(self, p: npt.NDArray[np.float64]) -> int:
        # `Generator.choice(len(p), p=p)` spelled out: the device sampler picks alike from `uniform`.
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
    """`token`'s log-probability and the `top` most likely, after penalties and bias, before
    temperature (vLLM's `processed_logprobs`): under greedy the most likely is the one chosen."""
    z = logits.astype(np.float64)
    z -= z.max()
    log_norm = np.log(np.exp(z).sum())
    alternatives: tuple[tuple[int, float], ...] = ()
    if top > 0:
        # Ties (frequent at low precision) in vocabulary order, as greedy's argmax takes them.
        kth = np.partition(z, z.size - min(top, z.size))[z.size - min(top, z.size)]
        ids = np.flatnonzero(z >= kth)
        ids = ids[np.lexsort((ids, -z[ids]))][:top]
        alternatives = tuple((int(i), float(z[i] - log_norm)) for i in ids)
    return TokenLogprob(token=token, logprob=float(z[token] - log_norm), top=alternatives)

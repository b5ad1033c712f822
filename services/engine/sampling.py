"""Choosing the next token from logits: greedy, or temperature + nucleus (top-p) sampling.

Pure and seeded, so that the same seed gives the same sample (OpenAI's `seed`).
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt


class Sampler:
    def __init__(self, temperature: float, top_p: float, seed: int | None,
                 repetition_penalty: float = 1.0) -> None:
        self.temperature = temperature
        self.top_p = top_p
        self.rng = np.random.default_rng(seed)
        self.repetition_penalty = repetition_penalty

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    def pick(self, logits: npt.NDArray[np.float32], context: list[int] | None = None) -> int:
        if self.repetition_penalty != 1.0 and context:
            # CTRL's penalty, as OpenVINO GenAI and HF apply it: every token already in the
            # context is made less likely (its logit divided if positive, multiplied if not).
            seen = np.unique(np.asarray(context, dtype=np.int64))
            logits = logits.copy()
            picked = logits[seen]
            logits[seen] = np.where(picked > 0, picked / self.repetition_penalty, picked * self.repetition_penalty)
        if self.greedy:
            return int(np.argmax(logits))
        z = logits.astype(np.float64) / self.temperature
        z -= z.max()
        p = np.exp(z)
        p /= p.sum()
        if self.top_p < 1.0:
            order = np.argsort(-p)
            cumulative = np.cumsum(p[order])
            # Smallest prefix whose mass reaches top_p (always at least the top token).
            keep = order[: int(np.searchsorted(cumulative, self.top_p)) + 1]
            q = p[keep] / p[keep].sum()
            return int(keep[self.rng.choice(len(keep), p=q)])
        return int(self.rng.choice(len(p), p=p))

"""A step's tokens for every row at once, on the logits' device: the engine's `Sampler` (greedy,
temperature, top-k, min-p, top-p) as tensor operations, where the host's costs a copy and ≈ 1.4 ms
of numpy a sampled row. Each row draws one uniform from its own request's generator and takes the
inverse CDF of it in the host's order (float64, ties in vocabulary order): a seed gives one token
on either path. Settings and draws travel in a small device table, so every step runs the same
kernels, as a CUDA graph needs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from services.engine.sampling import SAMPLING_EPS, Sampler, is_greedy


class RowDraw(NamedTuple):
    """One row's settings and its request's draw for this token: a column of a step's table."""

    temperature: float
    top_k: int
    top_p: float
    min_p: float
    uniform: float

    @classmethod
    def of(cls, sampler: Sampler) -> RowDraw:
        """`sampler`'s settings; a sampled (not greedy) row consumes its request's draw."""
        draw = 0.0 if is_greedy(sampler) else sampler.uniform()
        return cls(sampler.temperature, sampler.top_k, sampler.top_p, sampler.min_p, draw)


GREEDY = RowDraw(0.0, 0, 1.0, 0.0, 0.0)
"""A row whose device pick nobody reads (cancelled, or picked on the host)."""

COLUMNS = len(RowDraw._fields)


@dataclass(frozen=True)
class Branches:
    """The parts of the sampler a step needs, decided on the host so no branch waits for the
    device; a CUDA graph's step takes them all (`ALL`)."""

    sampled: bool = True
    top_k: bool = True
    min_p: bool = True
    nucleus: bool = True
    natural: bool = True
    """Some sampled row has no top_p: its CDF is in vocabulary order."""

    @classmethod
    def of(cls, rows: Sequence[RowDraw], vocab: int) -> Branches:
        sampled = [r for r in rows if not is_greedy(r)]
        return cls(
            bool(sampled),
            any(0 < r.top_k < vocab for r in sampled),
            any(r.min_p > 0.0 for r in sampled),
            any(r.top_p < 1.0 for r in sampled),
            any(r.top_p >= 1.0 for r in sampled),
        )


ALL = Branches()


def fill_table(table: torch.Tensor, rows: Sequence[RowDraw]) -> None:
    """Write `rows` into the first columns of `table` ([COLUMNS, >= len(rows)], float64)."""
    if rows:
        table[:, : len(rows)] = torch.tensor(rows, dtype=torch.float64).T


def pick_rows(logits: torch.Tensor, table: torch.Tensor, branches: Branches = ALL) -> torch.Tensor:
    """The token of each row of `logits` ([n, vocab]); `table` ([COLUMNS, n], float64, same
    device) holds each row's settings and draw. No wait for the device: a CUDA graph can hold it."""
    n, vocab = logits.shape
    argmax = logits.argmax(dim=-1)  # the first of equal maxima, as numpy's
    if not branches.sampled:
        return argmax
    temperature, top_k, top_p, min_p, uniform = (table[i, :n].unsqueeze(1) for i in range(COLUMNS))
    greedy = temperature.squeeze(1) < SAMPLING_EPS  # `is_greedy`, row by row
    z = logits.to(torch.float64) / torch.where(greedy.unsqueeze(1), 1.0, temperature)

    # One sort serves top-k and top-p: most likely first, equal values in vocabulary order (a
    # stable sort, as the host's). Probabilities follow the logits' order, and what top-k and
    # min-p take away is the least likely, so this order is the host's order of probabilities.
    if branches.top_k or branches.nucleus:
        ordered_z, order = torch.sort(z, dim=-1, descending=True, stable=True)
    if branches.top_k:
        # Below the k-th largest value goes; ties with it stay (the host's partition does alike).
        k = top_k.long()
        limited = (k > 0) & (k < vocab)
        kth = ordered_z.gather(1, (k.clamp(1, vocab) - 1))
        z = torch.where(limited & (z < kth), -torch.inf, z)

    z = z - z.max(dim=-1, keepdim=True).values
    p = torch.exp(z)
    p = p / p.sum(dim=-1, keepdim=True)
    if branches.min_p:
        cut = torch.where(p < min_p * p.max(dim=-1, keepdim=True).values, 0.0, p)
        p = torch.where(min_p > 0.0, cut / cut.sum(dim=-1, keepdim=True), p)

    nucleus = top_p.squeeze(1) < 1.0
    token = argmax
    if branches.nucleus:
        # The smallest prefix whose mass reaches top_p, renormalized; the draw's place in its CDF.
        cumulative = torch.cumsum(p.gather(1, order), dim=-1)
        keep = (torch.searchsorted(cumulative, top_p) + 1).clamp(max=vocab)
        kept_mass = cumulative.gather(1, keep - 1)
        positions = torch.arange(vocab, device=logits.device).unsqueeze(0)
        cdf = torch.where(positions < keep, cumulative / kept_mass, torch.inf)
        at = torch.searchsorted(cdf, uniform, right=True).clamp(max=vocab - 1)
        token = torch.where(nucleus, order.gather(1, at).squeeze(1), token)
    if branches.natural:
        cumulative = torch.cumsum(p, dim=-1)
        cdf = cumulative / cumulative[:, -1:]
        at = torch.searchsorted(cdf, uniform, right=True).clamp(max=vocab - 1).squeeze(1)
        token = torch.where(nucleus, token, at)
    return torch.where(greedy, argmax, token)

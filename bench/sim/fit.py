"""A simulated node's `Hardware` fitted to what a real engine measured, rather than to the
papers' testbeds (`hardware.CPU`, `hardware.GPU`).

The simulator's engine prefills first and runs decode rounds between prefills (`core`), so a
node needs two curves: a prefill's seconds for a prompt, and a decode iteration's seconds at a
batch. Both are fitted for one model on one kind of node (the curves ignore `params_b`):

- prefill: linear in the prompt, at `prefill_tok_s` (no fixed part: a short prompt's fixed
  cost cannot be told apart from the services' own overhead in a TTFT);
- decode: step(b) = a + c · b, least squares over measured (batch, step seconds) points. A
  real engine's step costs a fixed part (the model's weights read once per step) and a part
  per row (each row's attention, sampling, detokenizing and streaming). No length term: the
  points come from short requests, whose length changes the step little.

Where a node serves several models at once, its decode round is the sum of their
instances' iterations (`core`: a + c · b each, so a · k + c · rows for k instances holding
`rows` requests in all): `colocated_points` makes (k, rows, seconds per token) points from the
requests of every model on each node, and `fit_round` fits a and c to them. That is what
`bench.cluster`'s many-model setup measures; fitted to one model alone on a node, a and c
miss what instances cost beside each other (one worker process each, taking turns at the
node's CPU quota).

`decode_points` makes those points from the requests of a model served alone on a node
(`bench.cluster`'s exclusive run: one model per node), each a (mean batch over its decode,
its decode seconds per token) pair. Its decode seconds exclude the prefills that ran in its
window: the measured time per output token includes them (OpenVINO fuses a newcomer's prompt
into the running step), and the simulator prices them as prefills of their own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from bench.sim.hardware import Hardware


@dataclass(frozen=True)
class Timed:
    """One measured request as the fit reads it: sent, first token, last token (seconds)."""

    sent: float
    first: float
    last: float
    tokens: int
    model: str = ""
    node: str = ""


def decode_points(requests: Sequence[Timed], prefill_s: float) -> list[tuple[float, float]]:
    """(mean batch, decode seconds per token) of each request of one node's model.

    Its mean batch: the time-average, over its decode window [first, last], of the windows
    open at once (its own included). Its decode seconds per token: the window less the
    prefills of the requests whose first token came in it (`prefill_s` each), over the tokens
    after its first."""
    rs = [r for r in requests if r.tokens > 1 and r.last > r.first]
    if not rs:
        return []
    first = np.array([r.first for r in rs])
    last = np.array([r.last for r in rs])
    span = last - first
    overlap = np.clip(np.minimum(last[:, None], last[None, :]) - np.maximum(first[:, None], first[None, :]), 0, None)
    batch = overlap.sum(axis=1) / span
    starts_inside = ((first[None, :] > first[:, None]) & (first[None, :] < last[:, None])).sum(axis=1)
    decode = np.maximum(span - starts_inside * prefill_s, 0.0)
    steps = decode / np.array([r.tokens - 1 for r in rs])
    return [(float(b), float(s)) for b, s in zip(batch, steps, strict=True)]


def fit_step(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """(a, c) of step(b) = a + c · b, least squares; a and c kept non-negative."""
    b = np.array([p[0] for p in points])
    s = np.array([p[1] for p in points])
    a, c = np.linalg.lstsq(np.vstack([np.ones_like(b), b]).T, s, rcond=None)[0]
    return max(float(a), 0.0), max(float(c), 0.0)


def fitted_hardware(
    kind: str,
    *,
    prefill_tok_s: float,
    step: tuple[float, float],
    memory_bytes: int,
    load_bps: float,
    init_s: float,
    kv_copy_bps: float,
    loads_on_node: bool = False,
) -> Hardware:
    """A node whose prefill runs at `prefill_tok_s` and whose decode iteration at batch b takes
    step[0] + step[1] · b seconds, whatever the model's size (the fit is for one model)."""
    a, c = step

    def prefill(_params_b: float, length: int) -> float:
        return length / prefill_tok_s

    def decode(_params_b: float, batch: int, _length: int) -> float:
        return a + c * batch

    return Hardware(kind, memory_bytes, load_bps, init_s, kv_copy_bps, prefill, decode, loads_on_node)


def colocated_points(requests: Sequence[Timed], samples: int = 64) -> list[tuple[float, float, float]]:
    """(instances, rows, decode seconds per token) of each request: over its decode window
    [first, last], the time-averaged number of models decoding on its node (its own included)
    and of requests decoding there, against its window over the tokens after its first."""
    rs = [r for r in requests if r.tokens > 1 and r.last > r.first and r.node]
    out = []
    for r in rs:
        near = [o for o in rs if o.node == r.node and o.last > r.first and o.first < r.last]
        ts = np.linspace(r.first, r.last, samples)
        models = [len({o.model for o in near if o.first <= t <= o.last}) for t in ts]
        rows = [sum(1 for o in near if o.first <= t <= o.last) for t in ts]
        out.append((float(np.mean(models)), float(np.mean(rows)), (r.last - r.first) / (r.tokens - 1)))
    return out


def fit_round(points: Sequence[tuple[float, float, float]]) -> tuple[float, float]:
    """(a, c) of a round of k instances holding `rows` requests taking a · k + c · rows
    seconds, least squares over `colocated_points`; both kept non-negative."""
    x = np.array([[k, rows] for k, rows, _ in points])
    y = np.array([s for _, _, s in points])
    a, c = np.linalg.lstsq(x, y, rcond=None)[0]
    return max(float(a), 0.0), max(float(c), 0.0)

"""A request's cold-start budget (issue 35): how long its model's start is predicted to take,
and whether that is longer than the request will wait.

The prediction is the scheduler's load-time model from measured starts (`PerfBook.load_s`:
the median of the artifact's recent starts that loaded weights, else the other artifacts'
seconds per byte times its size, else a guess), as placement predicts a new instance's
readiness (`placement.validate`): a start whose weights are still resident takes
`RESIDENT_START_S`, one on a node with no prewarmed worker the spawn more; what a start under
way has done is taken off, and the prompts of the requests already waiting for it are
prefilled ahead of this one (the queue ahead). LLM-Mesh §5.3's 10 % overestimate on top.

A request over its budget for a scale-out (its model runs elsewhere, but no running instance
takes it within its SLOs) is not refused: it queues on the least busy running instance
(`warm_instead`), late rather than cold, and the start goes ahead for the requests after it.

Pure: numbers (or the live nodes) in, a forecast, a refusal or a node out.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from policy.placement import OVERESTIMATE, RESIDENT_START_S, NodeState
from shared.messages import ErrorCode, Rejected


@dataclass(frozen=True)
class Forecast:
    ready_in_s: float
    """Seconds until the model's instance there serves this request's prompt."""
    basis: str
    """What the load time came from: "resident", "measured" or "guessed" (never measured)."""


def forecast(
    *,
    load_s: float | None,
    guess_s: float,
    spawn_s: float = 0.0,
    resident: bool = False,
    prewarmed: bool = True,
    elapsed_s: float = 0.0,
    waiting: int = 0,
    prefill_s: float = 0.0,
) -> Forecast:
    """When a start of the model is ready for this request. `load_s`: its expected load (None:
    no start measured to go by, `guess_s` then); `resident`: its weights are still loaded on the
    node; `prewarmed`: the node has an idle worker to load them into (else `spawn_s` more);
    `elapsed_s`: how long a start under way there has run; `waiting`: requests already waiting
    for it, each prefilled in `prefill_s` (a prompt like this one's; 0: unknown)."""
    if resident:
        full, basis = RESIDENT_START_S, "resident"
    else:
        full = (guess_s if load_s is None else load_s) + (0.0 if prewarmed else spawn_s)
        basis = "guessed" if load_s is None else "measured"
    left = max(0.0, full - max(elapsed_s, 0.0))
    return Forecast(OVERESTIMATE * (left + max(waiting, 0) * prefill_s), basis)


def refusal(model: str, predicted: Forecast, budget_s: float | None) -> Rejected | None:
    """The answer for a request whose budget the start exceeds (None: it waits for it)."""
    if budget_s is None or predicted.ready_in_s <= budget_s:
        return None
    guessed = " (no start of it measured yet: a guess)" if predicted.basis == "guessed" else ""
    return Rejected(
        code=ErrorCode.MODEL_STARTING,
        message=f"model {model!r} is cold: its start is predicted ready in {predicted.ready_in_s:.2f} s{guessed}, "
        f"longer than this request's cold-start budget of {budget_s:g} s (X-Tessera-Max-Wait, "
        f"tessera.max_wait_s). The start goes ahead: retry after {math.ceil(predicted.ready_in_s)} s "
        "and the model will be warm",
        retry_after_s=predicted.ready_in_s,
    )


def warm_instead(model: str, live: Iterable[NodeState], max_active_per_instance: int) -> str | None:
    """The node of the least busy running instance of `model` below its limit of requests,
    where a request over its cold-start budget may queue instead of waiting for a start."""
    running = [(n.instances[model].active, n.node_id) for n in live if model in n.instances]
    free = [r for r in running if r[0] < max_active_per_instance]
    return min(free)[1] if free else None

"""Shadow validation: would adding a request to an instance make anyone miss an SLO? (§5.3)

Before a request joins an instance, the node's future is simulated with the request added,
stepping through the headroom scheduler of §5.1 (the most urgent instance runs next). Three
ways it can fail (LLM-Mesh Fig. 6):

1. the new request's own prefill finishes too late (its headroom goes negative);
2. a request already on the node is delayed past its headroom by that prefill;
3. one decode round over all instances on the node (each runs one iteration) now takes longer
   than the TPOT SLO, so in steady state every request falls behind.

Every iteration is overestimated by 10% (§5.3: runtime noise and sentence lengths that grow
during decode). All requests of an instance get the same iterations, so the simulation keeps
one headroom per instance (its least) rather than one per request: a request goes negative
exactly when its instance's least headroom does.

Candidates are tried CPU nodes first (the GPU is the scarce resource, §4), and within a kind
the instance with the highest batch first (§7.2: bin-packing lets small instances drain).

This module is §5.3 as the paper states it, with its Fig. 6 cases as tests, and holds the
verdicts and the overestimate placement shares. What the scheduler and the simulator run is
`placement.validate`: the same checks over what engines report (queues, rows, held tokens,
prefill slack) rather than every request's clock, for the engines this project has.

Pure: state and a clock in, a verdict out.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol, TypeVar

from policy.headroom import RequestClock
from policy.perf_model import PerfModel

OVERESTIMATE = 1.1
"""§5.3: each simulated iteration is taken 10% longer than the model predicts."""


class Failure(StrEnum):
    NEW_LATE = "new_request_late"
    EXISTING_LATE = "existing_request_late"
    ROUND_TOO_LONG = "decode_round_exceeds_tpot"


@dataclass(frozen=True)
class Pending:
    """A request on the instance whose prefill has not run yet."""

    input_len: int
    headroom_s: float
    """Its eq. 1 headroom (inf once already negative, see `least_headroom_s`)."""


@dataclass(frozen=True)
class ShadowInstance:
    """One instance on the node, as shadow validation sees it at `now`."""

    key: str
    perf: PerfModel
    batch: int = 0
    """Requests past their prefill (decoding)."""
    mean_length: float = 0.0
    """Mean sentence length (input + generated) of the decoding requests."""
    least_headroom_s: float = math.inf
    """The least eq. 1 headroom among the decoding requests still within their SLO. One
    already negative has missed it whatever is decided now; counting it would refuse every
    request to the node until it finished, which saves nothing."""
    pending: tuple[Pending, ...] = ()
    ready_in_s: float = 0.0
    """Seconds until the instance can run (a start still loading its weights)."""

    @classmethod
    def of(
        cls,
        key: str,
        perf: PerfModel,
        requests: Iterable[tuple[RequestClock, int]],
        now: float,
        ready_in_s: float = 0.0,
    ) -> ShadowInstance:
        """From per-request clocks, each with its input length."""
        batch, total, least = 0, 0, math.inf
        pending: list[Pending] = []
        for clock, input_len in requests:
            h = clock.headroom(now)
            if clock.generated == 0:
                pending.append(Pending(input_len, h if h >= 0 else math.inf))
            else:
                batch += 1
                total += input_len + clock.generated
                if h >= 0:
                    least = min(least, h)
        return cls(key, perf, batch, total / batch if batch else 0.0, least, tuple(pending), ready_in_s)

    def round_s(self, extra: int = 0, extra_length: float = 0.0) -> float:
        """Predicted seconds of one decode iteration, with `extra` requests added."""
        b = self.batch + len(self.pending) + extra
        if b == 0:
            return 0.0
        lengths = self.mean_length * self.batch + sum(p.input_len for p in self.pending)
        return self.perf.decode_s(b, (lengths + extra_length * extra) / b)


@dataclass(frozen=True)
class NewRequest:
    input_len: int
    headroom_s: float
    """Eq. 1 headroom now: TTFT SLO less the time it has already waited."""
    tpot_slo: float


@dataclass(frozen=True)
class Verdict:
    ok: bool
    failure: Failure | None = None
    round_s: float = 0.0
    """The predicted (overestimated) decode round of the node with the request added."""
    detail: str = ""


def validate(
    node: Sequence[ShadowInstance],
    target: str,
    new: NewRequest,
    *,
    overestimate: float = OVERESTIMATE,
    rounds_after: int = 2,
    max_iterations: int = 512,
) -> Verdict:
    """Whether `new` may join instance `target` on this node (all instances of the node given).

    `target` not among `node` means a new instance of that name (a scale-out), which must then
    be given in `node` with its perf model; this function does not invent one.
    """
    by_key = {i.key: i for i in node}
    if target not in by_key:
        raise KeyError(f"target instance {target!r} is not on the node")
    tpot = new.tpot_slo
    # Case 3 first: it needs no simulation and is the steady state that the rest assumes.
    total_round = 0.0
    for inst in node:
        if inst.key == target:
            total_round += inst.round_s(1, float(new.input_len))
        else:
            total_round += inst.round_s()
    total_round *= overestimate
    if total_round > tpot:
        return Verdict(
            False, Failure.ROUND_TOO_LONG, total_round, f"decode round {total_round:.3f}s > TPOT SLO {tpot:.3f}s"
        )

    # Fast accept: if every request can absorb all pending prefills plus one full round in any
    # order, no schedule can make one negative; the simulation below is then unnecessary.
    prefill_work = overestimate * (
        by_key[target].perf.prefill_s(new.input_len)
        + sum(i.perf.prefill_s(p.input_len) for i in node for p in i.pending)
    )
    worst_wait = max((i.ready_in_s for i in node), default=0.0) + prefill_work + total_round
    least = min([new.headroom_s] + [i.least_headroom_s for i in node] + [p.headroom_s for i in node for p in i.pending])
    if least >= worst_wait:
        return Verdict(True, None, total_round)
    return _simulate(node, target, new, total_round, overestimate, rounds_after, max_iterations)


def _simulate(
    node: Sequence[ShadowInstance],
    target: str,
    new: NewRequest,
    total_round: float,
    overestimate: float,
    rounds_after: int,
    max_iterations: int,
) -> Verdict:
    tpot = new.tpot_slo
    inf = math.inf
    # Per instance: [least, batch, length_sum, pending, ready_at, steps_after_new, decode_s,
    # perf, key]. A decode step's time is recomputed when the batch changes, not per token:
    # lengths grow by a few tokens over the horizon, which the 10% overestimate covers.
    sims: list[list] = []
    for i in node:
        pend = [(p.headroom_s, p.input_len, False) for p in i.pending]
        if i.key == target:
            pend.append((new.headroom_s, new.input_len, True))
        pend.sort()
        dec = overestimate * i.perf.decode_s(i.batch, i.mean_length) if i.batch else 0.0
        sims.append(
            [
                i.least_headroom_s if i.batch else inf,
                i.batch,
                i.mean_length * i.batch,
                pend,
                i.ready_in_s,
                0,
                dec,
                i.perf,
                i.key,
            ]
        )
    t = 0.0
    new_done = False
    for _ in range(max_iterations):
        best = None
        best_u = inf
        waiting_until = inf
        done = new_done
        for s in sims:
            if not s[1] and not s[3]:
                continue
            if done and s[5] < rounds_after:
                done = False
            if s[4] > t:
                waiting_until = min(waiting_until, s[4])
                continue
            u = s[0]
            if s[3] and s[3][0][0] < u:
                u = s[3][0][0]
            if best is None or u < best_u:
                best, best_u = s, u
        if done:
            break
        if best is None:
            if waiting_until == inf:
                break
            t = waiting_until
            continue
        s = best
        pend = s[3]
        if pend and (not s[1] or pend[0][0] <= s[0]):
            h, length, is_new = pend.pop(0)
            t += overestimate * s[7].prefill_s(length)
            if h - t < 0:
                failure = Failure.NEW_LATE if is_new else Failure.EXISTING_LATE
                return Verdict(False, failure, total_round, f"prefill on {s[8]} ends {t - h:.3f}s past its headroom")
            s[0] = min(s[0], h + tpot)
            s[1] += 1
            s[2] += length
            s[6] = overestimate * s[7].decode_s(s[1], s[2] / s[1])
            if is_new:
                new_done = True
        else:
            t += s[6]
            if s[0] - t < 0:
                return Verdict(
                    False,
                    Failure.EXISTING_LATE,
                    total_round,
                    f"decode on {s[8]} ends {t - s[0]:.3f}s past its headroom",
                )
            s[0] += tpot
            s[2] += s[1]
            if new_done:
                s[5] += 1
        for o in sims:
            if o[0] - t < 0 or (o[3] and o[3][0][0] - t < 0):
                is_new = any(p[2] for p in o[3])
                failure = Failure.NEW_LATE if is_new else Failure.EXISTING_LATE
                return Verdict(False, failure, total_round, f"a request on {o[8]} waits past its headroom")
    return Verdict(True, None, total_round)


class Candidate(Protocol):
    @property
    def kind(self) -> str: ...
    @property
    def batch(self) -> int: ...


C = TypeVar("C", bound=Candidate)


def order_candidates(candidates: Iterable[C]) -> list[C]:
    """The order to try instances in: CPU nodes first, then the highest batch first."""
    return sorted(candidates, key=lambda c: (c.kind != "cpu", -c.batch))

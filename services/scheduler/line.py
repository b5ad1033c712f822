"""The scheduler's line: requests that no node can take yet without breaking the SLOs of the
requests already there (`policy.scheduling.NoRoom`) wait here, first come first served per
model, and are placed as requests end and their room frees.

Without it such a request was either refused at once (429: under a 200-client crowd 96 % of
attempts were, and the refusals' own traffic took CPU from the engine) or sent to an instance
whose decode rounds it stretched past every request's TPOT SLO (vLLM's way: all 200 admitted,
TPOT 6 × its SLO). Waiting is bounded: by the gateway's own line budget, and with admission
on by `reject_over_slo` TTFT SLOs, after which the request gets `NoRoom.otherwise`.

Engines send a heartbeat soon after a request ends, and every heartbeat calls `serve`.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from policy.scheduling import Decision, NoRoom
from shared.routing_messages import PlaceRequest


@dataclass
class _Waiter:
    req: PlaceRequest
    order: int
    placed: asyncio.Future[Decision] = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class Line:
    def __init__(self) -> None:
        self._by_model: dict[str, deque[_Waiter]] = {}
        self._arrivals = itertools.count()

    def __len__(self) -> int:
        return sum(len(q) for q in self._by_model.values())

    def waiting(self, model: str) -> int:
        return len(self._by_model.get(model, ()))

    async def wait(self, req: PlaceRequest, timeout_s: float) -> Decision | None:
        """Wait in `req.model`'s line: the decision `serve` made for it, or None once
        `timeout_s` has passed without one."""
        waiter = _Waiter(req, next(self._arrivals))
        line = self._by_model.setdefault(req.model, deque())
        line.append(waiter)
        try:
            return await asyncio.wait_for(asyncio.shield(waiter.placed), timeout_s)
        except TimeoutError:
            if waiter.placed.done() and not waiter.placed.cancelled():
                return waiter.placed.result()  # placed just as its time ran out
            return None
        finally:
            if not waiter.placed.done():  # out of time, or its caller went away
                waiter.placed.cancel()
                if waiter in line:
                    line.remove(waiter)

    def serve(self, decide: Callable[[PlaceRequest], Decision]) -> int:
        """Place the heads of the lines while they find room: each model's in arrival order
        (a request never overtakes an earlier one of its model), the models in the order their
        heads arrived. `decide` is placement on the current view, which must count each
        decision it hands out before the next call (the scheduler's `_placed`). Returns how
        many it placed."""
        placed = 0
        stuck: set[str] = set()
        while True:
            heads = []
            for model, q in self._by_model.items():
                while q and q[0].placed.done():
                    q.popleft()  # gave up waiting
                if q and model not in stuck:
                    heads.append(q[0])
            if not heads:
                break
            head = min(heads, key=lambda w: w.order)
            decision = decide(head.req)
            if isinstance(decision, NoRoom):
                stuck.add(head.req.model)
                continue
            self._by_model[head.req.model].popleft()
            head.placed.set_result(decision)
            placed += 1
        for model in [m for m, q in self._by_model.items() if not q]:
            del self._by_model[model]
        return placed

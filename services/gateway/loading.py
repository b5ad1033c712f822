"""Progress in the stream (issue 35, part 4): while a streamed request waits for its model's
start, the gateway writes SSE comment lines `: tessera loading phase=load 41% eta=1.3s`, which
every SSE client ignores but which keep proxies and client timeouts from firing.

The lines come from the engine's own progress events (`StartProgress`, published by
`services/engine/progress.py`: the phase, the bytes of weights read, the measured bandwidth),
relayed to every stream waiting on that model; between two events the last line is written
again each `KEEPALIVE_S`, its ETA less the time since, and a stream's percentage never goes
back (a second start of the same model elsewhere, or a retried one, may report less).

A stream starts (status 200 and its headers) once an event shows a start under way for a
model one of its generations is still being placed on; a request whose placement is answered
first (warm, or refused: an unknown model) is answered exactly as before. An error that ends
the start after the headers left travels as the API's error event. A request with a
cold-start budget shows no progress: its refusal must be a 503 with `Retry-After`, which the
scheduler may send after a start of its model already reports.

`/v1/models` says where each model is (`model_states`): `loaded`, `loading` or `cold`, from
the scheduler's view.

The pure parts (`percent`, `eta_left`, `comment`, `Lines`, `model_states`) first, then `StartWatch`, the
gateway's one subscription to the progress events, and `Placing`, what a request waits on.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import time
from dataclasses import dataclass, field

from nats.aio.msg import Msg

from services.gateway.protocol import ModelState
from shared import subjects
from shared.bus import Bus, decode
from shared.errors import TesseraError
from shared.messages import ClusterStatus, ClusterStatusQuery, StartProgress

log = logging.getLogger(__name__)

KEEPALIVE_S = 1.0
"""The longest a waiting stream goes without a line."""
LIVE_S = 2.0
"""A start whose engine said nothing for this long is not taken as under way (an engine sends
its start's state every `TESSERA_PROGRESS_INTERVAL_S`, 0.2 s by default, until it ends)."""
ENDED = ("ready", "failed")


def percent(done_bytes: int, total_bytes: int) -> int:
    """Whole percent of the weights read (0 while the size is unknown), at most 100."""
    if total_bytes <= 0:
        return 0
    return max(0, min(100, math.floor(100 * done_bytes / total_bytes)))


def eta_left(eta_s: float | None, since_s: float) -> float | None:
    """An event's ETA `since_s` after it was received (never below 0; None stays unknown)."""
    return None if eta_s is None else max(0.0, eta_s - max(0.0, since_s))


def comment(phase: str, pct: int, eta_s: float | None) -> str:
    """The SSE comment line (and the blank line that ends it) for one step of a start."""
    eta = "?" if eta_s is None else f"{eta_s:.1f}s"
    return f": tessera loading phase={phase} {pct}% eta={eta}\n\n"


@dataclass
class Lines:
    """One stream's comment lines: its percentage never goes back."""

    pct: int = 0

    def line(self, event: StartProgress, since_s: float = 0.0) -> str:
        """The line for `event`, received `since_s` ago."""
        self.pct = max(self.pct, percent(event.done_bytes, event.total_bytes))
        return comment(event.phase, self.pct, eta_left(event.eta_s, since_s))


@dataclass
class Placing:
    """The models a request's generations are being placed on now (a placement answered, warm
    or refused, takes its model off before anything else runs: no line is written for it)."""

    models: collections.Counter[str] = field(default_factory=collections.Counter)
    since: float = field(default_factory=time.monotonic)
    """When the request began: older events belong to earlier starts."""


@dataclass(eq=False)
class StartWatch:
    """The latest progress event of every model's start, as this gateway heard them."""

    latest: dict[str, tuple[StartProgress, float]] = field(default_factory=dict)
    """Model → its latest event and when it was received (time.monotonic())."""
    _news: asyncio.Event = field(default_factory=asyncio.Event)

    async def start(self, bus: Bus) -> None:
        await bus.subscribe(subjects.start_progress(), self.on_progress)

    async def on_progress(self, msg: Msg) -> None:
        self.heard(decode(msg.data, StartProgress))

    def heard(self, event: StartProgress) -> None:
        self.latest[event.model] = (event, time.monotonic())
        news, self._news = self._news, asyncio.Event()
        news.set()

    def under_way(self, placing: Placing) -> tuple[StartProgress, float] | None:
        """The latest event (and when it came) of a start a generation of `placing` waits on:
        heard since the request began, or of a start still under way (not ended, heard within
        `LIVE_S`); None if there is none."""
        now = time.monotonic()
        for model, n in placing.models.items():
            seen = self.latest.get(model)
            if n <= 0 or seen is None:
                continue
            if seen[1] >= placing.since or (seen[0].phase not in ENDED and now - seen[1] <= LIVE_S):
                return seen
        return None

    async def news(self, timeout_s: float) -> None:
        """Returns at the next event (of any model), or after `timeout_s`."""
        try:
            await asyncio.wait_for(self._news.wait(), timeout_s)
        except TimeoutError:
            pass


def model_states(status: ClusterStatus) -> dict[str, ModelState]:
    """Each model with an instance running somewhere (`loaded`) or a start under way and none
    running (`loading`); a model absent is cold."""
    states: dict[str, ModelState] = {}
    for node in status.nodes:
        for model in (*status.starting, *node.starting):
            states.setdefault(model, "loading")
    for node in status.nodes:
        for inst in node.instances:
            states[inst.model] = "loaded"
    return states


async def cluster_states(bus: Bus, timeout_s: float) -> dict[str, ModelState] | None:
    """`model_states` of the scheduler's view now; None where the scheduler does not answer."""
    try:
        status = await bus.request(subjects.cluster_status(), ClusterStatusQuery(), ClusterStatus, timeout_s)
    except TesseraError as e:
        log.warning("no model states for /v1/models: %s", e.message)
        return None
    return model_states(status)

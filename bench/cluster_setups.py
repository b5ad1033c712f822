"""The work of the cluster capacity bench, by setup (issue 37): what `bench.cluster` sends to
the real services and `bench.sim.real_cluster` to the simulator, defined once for both.

- `three` (setup (a)): three models with different SLOs on 3 nodes, chat in bursts, assist
  and batch Poisson (`three_arrivals`; the table in `bench.cluster`'s docstring).
- `many` (setup (b)): `MANY_COUNT` models on 3 nodes, popularity and arrivals shaped as the
  Azure Functions trace LLM-Mesh and ServerlessLLM replay (`bench.trace.generate`: Zipf
  popularity, each model ON and OFF in periods of tens of seconds, `MANY_ON_MEAN_S` and
  `MANY_OFF_MEAN_S` on average). With a 30 s keep-alive a tail model's OFF period outlasts its
  instance: the exclusive baseline, one model per node, must stop it and start it again (and a
  model finds no free node while three others hold them), where Tessera shares the nodes.

Each model is a distinct artifact: the default GGUF with its own bytes appended (`suffix`;
b"": the GGUF itself), as fine-tunes of one base would be. A plan is deterministic for a seed,
and a rate scales the load and keeps its shape (the same models hot, the same ON/OFF periods),
so a capacity search compares like with like.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from bench.trace import generate

TOKENS = 32
"""Every request streams this many tokens (`ignore_eos`)."""

Plan = list[tuple[float, str]]
"""(seconds after the start, model) for every request of a run, by time."""


@dataclass(frozen=True)
class Model:
    name: str
    ttft_slo_s: float
    tpot_slo_s: float
    suffix: bytes  # appended to the GGUF: b"" is the default model itself


# --- setup (a): three models ---------------------------------------------------------------------

THREE_MODELS = (
    Model("chat", 1.5, 0.25, b""),
    Model("assist", 3.0, 0.25, b"\x00tessera-bench-assist"),
    Model("batch", 8.0, 0.5, b"\x00tessera-bench-batch"),
)


def base_rate(burst: int) -> float:
    """Setup (a)'s mean arrival rate (req/s) at scale 1: a `burst` of chat every 6 s on
    average, and the Poisson rates of assist and batch."""
    return burst / 6.0 + 0.25 + 0.15


def arrivals(seed: int, duration_s: float, burst: int = 4, spread_s: float = 0.0, scale: float = 1.0) -> Plan:
    """Setup (a)'s requests: `chat` in bursts of `burst` requests arriving over `spread_s`
    (0: at once); every model's rate times `scale`."""
    rng = random.Random(seed)
    out: Plan = []
    t = 2.0
    while t < duration_s:  # chat: bursts
        out += [(t + (spread_s * k / max(burst - 1, 1) if spread_s else 0.0), "chat") for k in range(burst)]
        t += rng.uniform(4.5, 7.5) / scale
    for name, rate in (("assist", 0.25), ("batch", 0.15)):
        t = rng.expovariate(rate * scale)
        while t < duration_s:
            out.append((t, name))
            t += rng.expovariate(rate * scale)
    return sorted(out)


def three_plan(seed: int, duration_s: float, burst: int, spread_s: float, rate: float) -> Plan:
    return arrivals(seed, duration_s, burst, spread_s, rate / base_rate(burst))


# --- setup (b): many models ----------------------------------------------------------------------

MANY_COUNT = 12
MANY_ON_MEAN_S = 15.0
MANY_OFF_MEAN_S = 45.0
"""Mean ON and OFF periods: tens of seconds, an OFF period often past the 30 s keep-alive
(an exponential 45 s mean outlasts 30 s in half its periods)."""
SLO_CLASSES = (("chat", 1.5, 0.25), ("assist", 3.0, 0.25), ("batch", 8.0, 0.5))
"""Setup (a)'s three SLOs, dealt round the models in turn (popularity is drawn apart from the
index: `generate` shuffles it), so hot and tail models of each class."""
MANY_START_RATE = 1.5
"""The search's first rate (req/s): about what the exclusive baseline serves (the simulator's
capacity for it; `bench/results/cluster.json`), so its search halves at most once."""

MANY_MODELS = tuple(
    Model(f"m{i:02d}-{cls}", ttft, tpot, f"\x00tessera-bench-many-{i:02d}".encode())
    for i, (cls, ttft, tpot) in ((i, SLO_CLASSES[i % len(SLO_CLASSES)]) for i in range(MANY_COUNT))
)


def many_plan(seed: int, duration_s: float, _burst: int, _spread_s: float, rate: float) -> Plan:
    """Setup (b)'s requests at a mean of `rate` req/s: `bench.trace.generate`'s arrivals and
    models (its lengths and sizes unused: every request is the bench's prompt and `TOKENS`)."""
    tr = generate(seed, MANY_COUNT, duration_s, rate, on_mean_s=MANY_ON_MEAN_S, off_mean_s=MANY_OFF_MEAN_S)
    return [(float(t), MANY_MODELS[m].name) for t, m in zip(tr.arrival.tolist(), tr.model.tolist(), strict=True)]


# --- the setups ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Setup:
    name: str
    title: str
    models: tuple[Model, ...]
    plan: Callable[[int, float, int, float, float], Plan]
    """(seed, seconds, burst, burst spread, rate) → the plan."""
    start_rate: Callable[[int], float]
    """The search's first rate for a burst (req/s)."""
    seed: int
    duration_s: float
    ramp_s: float


THREE = Setup("three", "a: 3 models, different SLOs, on 3 nodes", THREE_MODELS, three_plan, base_rate, 1, 40.0, 20.0)
MANY = Setup(
    "many",
    f"b: {MANY_COUNT} models, Azure-skewed popularity, ON/OFF tails, on 3 nodes",
    MANY_MODELS,
    many_plan,
    lambda _burst: MANY_START_RATE,
    # Seed 2: a 2-minute window whose realized rate is the nominal one at every rate the search
    # tries and where every model is called (seed 1's realizes 2x the nominal rate in two minutes
    # and leaves two tail models out), so the rates the search reports are the rates served.
    2,
    90.0,
    30.0,
)
"""Longer windows than (a)'s: ON/OFF periods of tens of seconds need minutes to come and go."""
SETUPS = {s.name: s for s in (THREE, MANY)}


@dataclass(frozen=True)
class Load:
    seed: int
    duration_s: float
    burst: int
    spread_s: float
    ramp_s: float = 0.0
    """Seconds of the rate's load sent before the measured `duration_s`, not counted: the
    policy's answer to a new rate (a scale-out and its start, its core built beside the
    load) settles, as it would within LLM-Mesh's 30-minute traces; one burst's transient
    otherwise decides a 40-second window (measured: 0.40 at a rate whose next visit met 1.00)."""
    setup: Setup = THREE

    def plan(self, rate: float) -> Plan:
        return self.setup.plan(self.seed, self.ramp_s + self.duration_s, self.burst, self.spread_s, rate)

    def counted(self, results: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [r for r in results if r["at_s"] >= self.ramp_s]

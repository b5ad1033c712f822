"""The request trace of `bench/serverless.py`: many models, skewed popularity, bursty arrivals,
time-compressed to minutes.

Shaped like the Azure Functions trace (Shahrad et al., "Serverless in the Wild", ATC 2020):
popularity is heavy-tailed (a few functions take most invocations, most are called rarely) and
a function's inter-arrival times vary far more than a Poisson process's (coefficient of
variation well above 1). Here, from a seed:

- model of popularity rank r (0 the most popular) has a mean rate proportional to
  1 / (r + 1)^ZIPF_S, the rates summing to the trace's `rate_per_s`;
- each model's arrivals are a renewal process with log-normal inter-arrival times of that
  mean and log-std `IAT_SIGMA` (CV ≈ 2.9: bursts of close requests, then long silences),
  starting at a uniformly random phase of its first gap.

The models' rates come from the popularity alone and each model's draws from its own stream
(seed, rank), so changing the duration keeps every model's pattern up to the cut.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

ZIPF_S = 1.0
IAT_SIGMA = 1.5
"""Log-std of the inter-arrival times: CV = sqrt(exp(sigma^2) - 1) ≈ 2.9."""


@dataclass(frozen=True)
class Arrival:
    at_s: float
    rank: int
    """The model's popularity rank."""


def mean_rates(n_models: int, rate_per_s: float) -> list[float]:
    weights = [1.0 / (r + 1) ** ZIPF_S for r in range(n_models)]
    total = sum(weights)
    return [rate_per_s * w / total for w in weights]


def model_arrivals(seed: int, rank: int, rate_per_s: float, duration_s: float) -> list[float]:
    """One model's arrival times in [0, duration_s)."""
    if rate_per_s <= 0:
        return []
    rng = np.random.default_rng([seed, rank])
    mu = math.log(1.0 / rate_per_s) - IAT_SIGMA**2 / 2  # a log-normal's mean is exp(mu + sigma^2/2)
    t = rng.uniform(0.0, 1.0) * float(rng.lognormal(mu, IAT_SIGMA))
    out = []
    while t < duration_s:
        out.append(t)
        t += float(rng.lognormal(mu, IAT_SIGMA))
    return out


def generate(seed: int, n_models: int, rate_per_s: float, duration_s: float) -> list[Arrival]:
    """Every model's arrivals, sorted by time."""
    arrivals = [
        Arrival(t, rank)
        for rank, rate in enumerate(mean_rates(n_models, rate_per_s))
        for t in model_arrivals(seed, rank, rate, duration_s)
    ]
    return sorted(arrivals, key=lambda a: (a.at_s, a.rank))


def popularity(arrivals: list[Arrival], n_models: int) -> list[int]:
    """Requests per rank."""
    counts = [0] * n_models
    for a in arrivals:
        counts[a.rank] += 1
    return counts

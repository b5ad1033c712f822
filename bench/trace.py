"""A seeded multi-model bursty trace, shaped like the Azure Functions traces the papers replay.

LLM-Mesh §8.1 and ServerlessLLM map each model to a function of the Azure Serverless trace and
take request lengths from the Azure LLM conversation trace. Neither is bundled here, so this
module draws a trace with the same shape from a seed:

- popularity is heavy-tailed: model m's mean rate is proportional to 1 / rank^ZIPF_S, so a few
  models carry most requests and most models are rarely called (each such call is a cold
  start unless its weights are still resident);
- arrivals are bursty: each model alternates OFF and ON periods (exponential lengths) and its
  Poisson rate during ON is many times that during OFF, keeping its mean rate;
- input and output lengths are log-normal, with medians near the Azure conversation trace's
  (about 1k tokens in, a couple of hundred out), clipped to a 4k context;
- model sizes mix 3B, 7B and 13B (LLM-Mesh §8.4; small models dominate, 4:1:1).

Scaling the request rate by a factor keeps the same models, popularity and ON/OFF pattern
(they come from their own random stream), so a capacity search compares like with like.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

ZIPF_S = 1.0
ON_MEAN_S = 20.0
OFF_MEAN_S = 120.0
OFF_INTENSITY = 0.05
"""Rate during OFF periods, as a fraction of the model's mean rate."""
INPUT_MEDIAN, INPUT_SIGMA = 800.0, 0.9
OUTPUT_MEDIAN, OUTPUT_SIGMA = 160.0, 0.8
MAX_CONTEXT = 4096

SIZES_B = (3.0, 7.0, 13.0)
SIZE_MIX = (4.0, 1.0, 1.0)
"""LLM-Mesh §8.4's "small models dominate" mix."""

TPOT_SLO = 0.25
"""LLM-Mesh §3.1, §8.1: every model's TPOT SLO unless its spec says otherwise."""
TTFT_SLO_S = 2.0
"""LLM-Mesh §3.1, §8.1: a request of L prompt tokens has max(2, L / 512) s to its first token,
this floor and the registration's default allowance per token (`policy.slo.ttft_slo`, as the
scheduler and the gateway judge it)."""


@dataclass(frozen=True)
class ModelSpec:
    name: str
    params_b: float
    weight_bytes: int
    kv_bytes_per_token: int
    ttft_slo_s: float = TTFT_SLO_S
    """Its TTFT SLO's floor, as a registration sets it (`policy.slo.ttft_slo` grows it with
    the prompt): a request's TTFT SLO is its model's."""
    tpot_slo_s: float = TPOT_SLO
    """Its TPOT SLO, as a registration sets it: a request's is its model's."""


def model_spec(name: str, params_b: float) -> ModelSpec:
    """fp16 weights (2 bytes a parameter); KV per token from the Llama shapes: 7B (32 layers,
    4096 wide, no GQA) 512 KiB, 13B (40 × 5120) 800 KiB, Llama-3.2-3B (28 layers, GQA 8 of 24
    heads) 112 KiB."""
    kv = {3.0: 112 * 1024, 7.0: 512 * 1024, 13.0: 800 * 1024}.get(params_b, int(params_b * 75 * 1024))
    return ModelSpec(name, params_b, int(params_b * 2e9), kv)


@dataclass(frozen=True)
class Trace:
    models: tuple[ModelSpec, ...]
    duration_s: float
    arrival: np.ndarray
    """Seconds, sorted ascending."""
    model: np.ndarray
    """Index into `models`."""
    input_len: np.ndarray
    output_len: np.ndarray

    def __len__(self) -> int:
        return int(self.arrival.shape[0])


def generate(
    seed: int,
    n_models: int,
    duration_s: float,
    rate_per_s: float,
    size_mix: tuple[float, ...] = SIZE_MIX,
    *,
    on_mean_s: float = ON_MEAN_S,
    off_mean_s: float = OFF_MEAN_S,
) -> Trace:
    """A trace of `n_models` models over `duration_s` seconds at a mean of `rate_per_s`, each
    model's ON and OFF periods `on_mean_s` and `off_mean_s` long on average."""
    shape = np.random.default_rng([seed, 0])  # models, popularity, bursts: fixed by the seed
    draws = np.random.default_rng([seed, 1, round(rate_per_s * 1e6)])

    mix = np.asarray(size_mix, dtype=float)
    sizes = shape.choice(np.asarray(SIZES_B), size=n_models, p=mix / mix.sum())
    models = tuple(model_spec(f"m{i:05d}-{s:g}b", float(s)) for i, s in enumerate(sizes))
    weights = 1.0 / np.arange(1, n_models + 1) ** ZIPF_S
    shape.shuffle(weights)  # popularity is not tied to the model's size or index
    mean_rates = rate_per_s * weights / weights.sum()

    p_on = on_mean_s / (on_mean_s + off_mean_s)
    on_factor = (1.0 - (1.0 - p_on) * OFF_INTENSITY) / p_on

    arrivals: list[np.ndarray] = []
    owners: list[np.ndarray] = []
    n_periods = int(duration_s / (on_mean_s + off_mean_s) * 2) + 8
    for m in range(n_models):
        # ON/OFF periods, starting in a random phase.
        lens = np.empty(2 * n_periods)
        lens[0::2] = shape.exponential(off_mean_s, n_periods)
        lens[1::2] = shape.exponential(on_mean_s, n_periods)
        ends = np.cumsum(lens) - shape.uniform(0, off_mean_s + on_mean_s)
        starts = np.concatenate(([ends[0] - lens[0]], ends[:-1]))
        keep = (ends > 0) & (starts < duration_s)
        starts, ends = np.clip(starts[keep], 0, duration_s), np.clip(ends[keep], 0, duration_s)
        is_on = (np.nonzero(keep)[0] % 2) == 1
        rate = mean_rates[m] * np.where(is_on, on_factor, OFF_INTENSITY)
        counts = draws.poisson(rate * (ends - starts))
        total = int(counts.sum())
        if total == 0:
            continue
        seg = np.repeat(np.arange(len(counts)), counts)
        t = starts[seg] + draws.uniform(0.0, 1.0, total) * (ends[seg] - starts[seg])
        arrivals.append(t)
        owners.append(np.full(total, m, dtype=np.int32))
    if arrivals:
        arrival = np.concatenate(arrivals)
        model = np.concatenate(owners)
    else:
        arrival, model = np.zeros(0), np.zeros(0, dtype=np.int32)
    order = np.argsort(arrival, kind="stable")
    arrival, model = arrival[order], model[order]
    n = arrival.shape[0]
    inp = np.clip(draws.lognormal(np.log(INPUT_MEDIAN), INPUT_SIGMA, n), 16, MAX_CONTEXT // 2)
    out = np.clip(draws.lognormal(np.log(OUTPUT_MEDIAN), OUTPUT_SIGMA, n), 4, 1024)
    return Trace(models, duration_s, arrival, model, inp.astype(np.int32), out.astype(np.int32))

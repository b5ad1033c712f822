"""Discrete-event simulator of a shared CPU/GPU cluster serving many models (issue 6).

    .venv/bin/python -m bench.sim [--quick] [--out bench/results]

It replays a seeded bursty multi-model trace (`bench.trace`) on N CPU and M GPU nodes with the
services' policy code: every Tessera placement is `policy.scheduling.place` (shadow
validation by `placement.validate`, compute preemption, starts by affinity, the early reject
that is its admission), over `placement.NodeState` views that the simulator's nodes and
instances implement; memory is the memory manager's station, KV watermark and tensor pool
(Tangram's eviction rule, `policy.eviction`), with defrag's choice of idle neighbours to
preempt for memory. What the simulator adds is only what the cluster does: the engines, the
loads and resizes, the clock. Where the services differ: their engine (OpenVINO on CPU)
batches as `max_batch` and `join_recompute_tokens` say, which `placement.validate` predicts in
its batching branch; the simulated nodes run the paper's engine (and vLLM's), continuous
batching prefill-first, which it predicts in its continuous branch. Two baselines:

- `exclusive`: a Knative / ServerlessLLM deployment (LLM-Mesh §8.1's sllm+cpu): one model per
  instance and one instance per node (the node's whole memory is the instance's), CPU nodes
  first; a new instance (scale-out) when every instance of the model is at its concurrency
  limit, tuned per model size and node kind from the same perf model (LLM-Mesh §8.1's "best
  tailored" limits); a fixed keep-alive; requests wait FIFO for a slot. Its weights load from
  the host cache at the same bandwidth as Tessera's (LLM-Mesh §8.1: all models cached in CPU
  memory, the same loader for every system).
- `gpu_only`: Tessera's policies on the GPU nodes alone (the CPU nodes removed).

The package, by what each part handles:

- `hardware.py`: the node kinds' timing curves and costs (LLM-Mesh Figs. 1-3, Tangram eq. 3,
  Fig. 8), the default SLOs (LLM-Mesh §3.1, §8.1; each model's are its `ModelSpec`'s), the
  policies simulated (`Policy`), the testbed a run is on and judged by (`Testbed`).
- `state.py`: requests, instances and nodes as placement sees them and as they run (`Req`,
  `Inst`, `Node`), and a run's `Stats`.
- `core.py`: `SimCore`, the simulator's state, its indexes and event queue, and what a node
  does (LLM-Mesh §5.1: prefill first, decode rounds in between) and the SLO accounting (eq. 1).
- `memory.py`: `SimMemory(SimCore)`, the station's memory operations and KV sizing (eq. 2,
  §6.2).
- `placement.py`: `SimPlacement(SimMemory)`, where requests go and instances start and stop:
  Tessera's (`sched.place`, §7.1 preemption) and the exclusive baseline's (LLM-Mesh §8.1).
- `simulator.py`: `Sim(SimPlacement)`, the event loop dispatching to the layers; `simulate`.
- `scale.py`: the scale run (cells in parallel) and the capacity search.
- `fit.py`: a node's `Hardware` fitted to a real engine's measurements (prefill tok/s, decode
  step vs batch).
- `real_cluster.py`: `bench.cluster`'s setups on the simulator (issue 37, `bench.cluster_setups`: its models
  and SLOs, arrivals, ramp, keep-alive, judgement, search; exclusive with no scale-out; the
  scheduler's line), run by `python -m bench.cluster --setup NAME --sim-only`.
- `__main__.py`: the command line and its plot.
"""

from bench.capacity import SLO_TARGET
from bench.sim.core import KEEPALIVE, LINE, NODE_NEXT, OP_DONE, PF_DONE, READY, SAMPLE, TICK, SimCore
from bench.sim.hardware import (
    CPU,
    DEFAULT_MEAN_OUTPUT,
    EPS,
    EXCLUSIVE,
    GB,
    GPU,
    GPU_ONLY,
    L_MIN_TOKENS,
    LLM_MESH,
    RESIZE_FIXED_S,
    TESSERA,
    TPOT_SLO,
    TTFT_SLO_S,
    TYPICAL_LENGTH,
    UNLOAD_S,
    Hardware,
    Policy,
    Testbed,
    cpu_decode,
    cpu_prefill,
    first_kv_bytes,
    gpu_decode,
    gpu_prefill,
)
from bench.sim.memory import SimMemory
from bench.sim.placement import SimPlacement
from bench.sim.scale import EXCLUSIVE_GRID, ScaleJob, Setup, capacity, cell_trace, merge, run_at, scale_run
from bench.sim.simulator import Sim, simulate
from bench.sim.state import Inst, Node, Req, Stats

__all__ = [
    "CPU",
    "DEFAULT_MEAN_OUTPUT",
    "EPS",
    "EXCLUSIVE",
    "EXCLUSIVE_GRID",
    "GB",
    "GPU",
    "GPU_ONLY",
    "KEEPALIVE",
    "LINE",
    "LLM_MESH",
    "L_MIN_TOKENS",
    "NODE_NEXT",
    "OP_DONE",
    "PF_DONE",
    "READY",
    "RESIZE_FIXED_S",
    "SAMPLE",
    "SLO_TARGET",
    "TESSERA",
    "TICK",
    "TPOT_SLO",
    "TTFT_SLO_S",
    "TYPICAL_LENGTH",
    "UNLOAD_S",
    "Hardware",
    "Inst",
    "Node",
    "Policy",
    "Req",
    "ScaleJob",
    "Setup",
    "Sim",
    "SimCore",
    "SimMemory",
    "SimPlacement",
    "Stats",
    "Testbed",
    "capacity",
    "cell_trace",
    "cpu_decode",
    "cpu_prefill",
    "first_kv_bytes",
    "gpu_decode",
    "gpu_prefill",
    "merge",
    "run_at",
    "scale_run",
    "simulate",
]

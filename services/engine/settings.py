from __future__ import annotations

from shared.settings import CommonSettings


class EngineSettings(CommonSettings):
    http_port: int = 8104
    worker_pool_size: int = 1
    """Worker processes kept pre-warmed (runtime imported, bound to no model)."""
    worker_refill_delay_s: float = 5.0
    """Latest time after a start took a warm worker that its replacement begins warming (sooner
    once that start has its first token)."""
    max_batch: int = 16
    """Most requests a worker decodes together (within one name's KV reservation); 1: one at a time."""
    join_recompute_tokens: int = 256
    """A request may join a running start-tier batch while its rows total at most this many
    tokens: joining prefills them again (≈ 1 ms per token on one core). 0: wait for the next."""
    interleave: bool = True
    """Instances take turns per iteration, the least headroom first (LLM-Mesh §5.1); False: as the
    OS schedules them."""
    worker_prefault_mb: int = 320
    """Heap each pre-warmed worker touches before it is bound, so a start does not fault it in
    (≈ 0.06 s of a start measured). 0: none."""
    load_timeout_s: float = 300.0
    stage_host: str = "127.0.0.1"
    """Where a torch node's pipeline stages listen (FaaScale §4.3): an address other nodes reach."""
    cpu_cores: str = ""
    """The node's cores (`0-1,3`), for the engine and its workers; empty: all."""
    cpu_quota: float = 0.0
    """The node's share of CPU time in cores (a cgroup CFS quota where one can be made); 0: none.
    Also bounds how many iterations the headroom gate runs at once."""
    start_cpu_share: float = 1.0
    """Share of the node's cores (as runtime threads) a start may use while other instances
    generate. 1.0 by default: on 2 cores bench/nostall.py measured a 0.5 share hurting the busy
    instance more than it protected it; a bound pays on nodes with more cores."""
    memory_request_timeout_s: float = 5.0
    memory_wait_s: float = 30.0
    """How long a start may wait for busy instances to go idle when out of memory (then 503)."""
    pool_budget_bytes: int = 6 * 1024**3
    """Bytes of compiled models kept resident after their instances scaled to zero (each counted
    at what its worker holds). Three quarters of the memory manager's default budget: a start
    that needs room evicts idle residents at the lowest cost anyway (`KvMemory.reserve`), so
    this only bounds the memory idle models hold when nothing else wants it; at 2 GiB an
    8B-class model (3.7 GB of int4 weights) could never stay resident."""
    true_up_interval_s: float = 2.0
    """How often each bound worker's weights reservation is trued up to its measured footprint;
    0: off (the budget counts weights and KV as reserved at start)."""
    start_tier: bool = True
    """Starts load the START tier (cheapest first pass) and tier up to STEADY (fastest decode)
    once idle; False: STEADY directly."""
    tier_up_idle_s: float = 0.5
    """How long the node must have been idle before a START worker tiers up (≈ 1 core-second,
    kept off every request's path)."""
    torch_arena_bytes: int = 4 * 1024**3
    """torch: the node's tensor arena (`node_arena.py`, mapped by every worker), holding the
    weights of the models served and, idle, of those served before (Tangram §3.1)."""
    torch_shared_arena: bool = True
    """torch: one arena for the node rather than one per worker, so weights outlive their worker
    (a CUDA node needs `python -m cuda_ext.build`; without it each worker makes its own)."""
    torch_kv_tokens: int = 8192
    """torch or vllm: tokens of the paged KV cache each worker allocates when it binds a model,
    and the longest prompt + completion it takes."""
    progress_interval_s: float = 0.2
    """A cold start's progress events (`services/engine/progress.py`): at most one per this
    interval within a phase (each phase change at once), and how often its Load is sampled."""
    stream_interval_s: float = 0.1
    """Text produced within this interval travels as one message (the first piece at once): each
    wakes NATS, the gateway and the client on the decoding cores (bench/serving.py at c=1: TPOT
    1.16x the in-process pipeline's at 0.03 s, 0.94x at 0.1 s)."""


def parse_cores(spec: str) -> set[int]:
    """`0-1,3` → {0, 1, 3}."""
    cores: set[int] = set()
    for part in spec.split(","):
        part = part.strip()
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cores.update(range(int(lo), int(hi or lo) + 1))
    if not cores:
        raise ValueError(f"no cores in {spec!r}")
    return cores

from __future__ import annotations

from shared.settings import CommonSettings


class EngineSettings(CommonSettings):
    http_port: int = 8104
    worker_pool_size: int = 1
    """Worker processes kept pre-warmed (runtime imported, bound to no model)."""
    worker_refill_delay_s: float = 5.0
    """Latest time after a start took a warm worker that its replacement begins warming (it
    begins as soon as that start has its first token)."""
    max_batch: int = 16
    """Most requests a worker decodes together (`batch.py`); a batch also stays within one
    name's KV reservation (rows × (longest prompt + largest max_tokens) ≤ the context
    length). 1: one request at a time."""
    join_recompute_tokens: int = 256
    """A request may join a running batch (instead of waiting for it to end) while the running
    rows' prompts and output so far total at most this many tokens: joining prefills them again
    (≈ 1 ms per token on one core here). 0: requests wait for the next batch."""
    interleave: bool = True
    """Instances on this node take turns per iteration, the one with the least headroom first
    (LLM-Mesh §5.1, `step_gate.py`); False: they run side by side as the OS schedules them."""
    worker_prefault_mb: int = 320
    """Heap each pre-warmed worker touches before it is bound (its pages are then reused by
    the start instead of faulting in on its path; ≈ 0.06 s of a start measured); counted in
    `tessera_engine_prewarmed_rss_bytes`. 0: none."""
    load_timeout_s: float = 300.0
    stage_host: str = "127.0.0.1"
    """Where a torch node's pipeline stages listen (FaaScale §4.3): an address the other nodes
    reach, as the loader's `peer_host` for its blocks."""
    cpu_cores: str = ""
    """The node's cores (`0-1,3`), applied to the engine and so to its workers; empty: all.
    Nodes sharing a machine get their own core share this way."""
    cpu_quota: float = 0.0
    """The node's share of CPU time, in cores (`cpu_quota.py`: a cgroup CFS quota around the
    engine and its workers, where one can be made); 0: none. Also how many iterations the
    headroom gate runs at once (this over the inference threads)."""
    start_cpu_share: float = 1.0
    """Share of the node's cores a start may use while other instances are generating: its
    load, first forward pass and start tier get that many runtime threads (OpenVINO sets its
    own threads' affinity, so pinning alone does not bound them: `tests/e2e/test_start_share.py`
    reads the count back). 1.0 (no bound) by default: on 2 cores, bench/nostall.py measured a
    0.5 share hurting the busy instance more than it protected it (then enforced by pinning,
    which OpenVINO's threads escape onto the busy one's core). A bound pays on nodes with more
    cores than one instance uses."""
    memory_request_timeout_s: float = 5.0
    memory_wait_s: float = 30.0
    """How long a start may wait for busy instances to go idle when the node is out of memory
    (then it is refused, 503 with Retry-After)."""
    pool_budget_bytes: int = 2 * 1024**3
    """Bytes of compiled models kept resident after their instances scaled to zero."""
    true_up_interval_s: float = 2.0
    """How often each bound worker's weights reservation is trued up to its measured footprint
    (`policy.footprint`); 0 turns the true-up off, and the budget then counts weights and KV
    as reserved at start."""
    start_tier: bool = True
    """Starts load the artifact's START tier (cheapest first forward pass) and tier up to the
    STEADY one (fastest decode) once idle; False: starts load STEADY directly."""
    tier_up_idle_s: float = 0.5
    """How long the whole node must have been idle before a worker on the START tier tiers up
    (the tier-up takes ≈ 1 core-second; doing it while nothing runs keeps it off every
    request's path, the neighbours' included)."""
    torch_arena_bytes: int = 4 * 1024**3
    """With `engine_backend` torch: the node's tensor arena (`services/engine/node_arena.py`:
    one per device, owned by the engine and mapped by every torch worker, by CUDA IPC on a
    GPU; host memory whose pages are taken only as tensors land elsewhere), holding the
    weights of the models its workers serve and, idle, of those they served (Tangram §3.1).
    SmolLM2-135M in float32 takes 0.54 GB of it."""
    torch_shared_arena: bool = True
    """With `engine_backend` torch: one arena for the node rather than one per worker, so
    weights outlive the worker that loaded them (a CUDA node needs the CUDA extension built,
    `python -m cuda_ext.build`; without it each worker makes its own)."""
    torch_kv_tokens: int = 8192
    """With `engine_backend` torch or vllm: tokens of the paged KV cache each worker's
    continuous batch allocates when it binds a model (`torch_engine/batching.py`: 32-token
    blocks shared by the batch's requests, prefixes included; vLLM's cache is sized to as many,
    `vllm_engine/batch.py`), and the longest prompt + completion it takes. SmolLM2-135M in float32 takes 45 KiB a token:
    0.38 GB for the default, one full context."""
    stream_interval_s: float = 0.1
    """Text produced within this interval travels as one message (the first piece at once).
    Every message wakes the engine, NATS, the gateway and the client on the cores that decode:
    measured with bench/serving.py at c=1, TPOT was 1.16x the in-process pipeline's at 0.03 s
    and 0.94x at 0.1 s (ten updates a second still read as a smooth stream)."""


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

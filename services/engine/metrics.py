"""The engine's Prometheus metrics (served on its /metrics)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

PHASE_SECONDS = Histogram(
    "tessera_coldstart_phase_seconds",
    "Seconds spent in each phase of a cold start",
    ["phase"],
    buckets=(0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32),
)
COLD_START_SECONDS = Histogram(
    "tessera_coldstart_seconds",
    "Start request received to first token of the request that caused it",
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32),
)
DECODED_TOKENS = Counter("tessera_engine_decoded_tokens_total", "Tokens decoded by this engine")
REQUESTS = Counter("tessera_engine_requests_total", "Generations ended", ["finish_reason"])
INSTANCES = Gauge("tessera_engine_instances", "Model instances serving on this engine")
PIPELINED = Gauge(
    "tessera_engine_pipelined_instances", "Instances served through an execution pipeline until their replica is whole"
)
STAGE_WORKERS = Gauge("tessera_engine_stage_workers", "Workers running a pipeline stage for other nodes")
RESIDENT_BYTES = Gauge("tessera_engine_resident_model_bytes", "Weight bytes of bound workers, in use or not")
POOL_IDLE_BYTES = Gauge("tessera_engine_pool_idle_bytes", "Weight bytes kept resident with no instance (reusable)")
POOL_HITS = Counter("tessera_engine_pool_hits_total", "Starts that found their model resident")
POOL_EVICTIONS = Counter("tessera_engine_pool_evictions_total", "Resident models evicted")
ARENA_BYTES = Gauge(
    "tessera_engine_arena_bytes",
    "Tensor bytes in the node's one arena (torch nodes): held by a worker's model, or idle (resident, reusable)",
    ["state"],
)
ARENA_LOADS = Counter(
    "tessera_engine_arena_load_bytes_total",
    "Tensor bytes of the models bound in the node's arena: copied in, or reused (resident already, by content hash)",
    ["how"],
)
ARENA_STREAMED = Counter(
    "tessera_engine_arena_streamed_bytes_total",
    "Of the bytes starts copied into the node's arena, those copied after the start was admitted "
    "(TIDAL: streamed in behind the first forward pass)",
)
PREWARMED = Gauge("tessera_engine_prewarmed_workers", "Worker processes warm and bound to no model")
PREWARMED_BYTES = Gauge("tessera_engine_prewarmed_rss_bytes", "Resident memory of the pre-warmed workers")
UNACCOUNTED_BYTES = Gauge(
    "tessera_engine_unaccounted_bytes",
    "Memory bound workers hold beyond what the node's memory manager granted them (a true-up it refused)",
)
WORKER_RSS_BYTES = Gauge("tessera_engine_bound_workers_rss_bytes", "Resident memory of workers bound to models")
COLD_WORKERS = Counter("tessera_engine_unwarmed_starts_total", "Starts that found no pre-warmed worker")
INSTANCE_EVICTIONS = Counter(
    "tessera_engine_instance_evictions_total", "Idle instances ended early to make room for a start"
)
REIMPORTS = Counter(
    "tessera_engine_reimports_total", "Starts that imported a blob again because its block check failed"
)
BOUND_BY_TIER = Gauge("tessera_engine_bound_workers", "Workers bound to a model, by compiled tier", ["tier"])
TIER_UPS = Counter("tessera_engine_tier_ups_total", "Workers that swapped START for STEADY", ["result"])
TIER_UP_SECONDS = Histogram(
    "tessera_engine_tier_up_seconds",
    "Seconds a background tier-up took (load of the STEADY blob and its first pass)",
    buckets=(0.1, 0.25, 0.5, 1, 2, 4, 8, 16),
)
QUEUE_WAIT = Histogram(
    "tessera_engine_queue_wait_seconds",
    "Generate received to its run starting on the worker (requests ahead on the same worker)",
    buckets=(0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32),
)
BATCHED_REQUESTS = Counter(
    "tessera_engine_batched_requests_total",
    "Requests run, by the size of the batch they ran in",
    ["batch"],
)
KV_RESERVED = Gauge(
    "tessera_engine_kv_reserved_bytes",
    "KV cache bytes reserved per serving model name (LLM-Mesh eq. 2 with the watermark)",
    ["model"],
)
KV_ALLOCATED = Gauge(
    "tessera_engine_kv_allocated_bytes",
    "KV cache bytes the continuous-batching core has allocated per serving model name (it grows "
    "with the requests admitted under the reservation; freed blocks stay in its pool)",
    ["model"],
)
KV_RESIZES = Counter("tessera_engine_kv_resizes_total", "KV reservations resized by the watermark rule", ["direction"])
PREEMPTIONS = Counter(
    "tessera_engine_preemptions_total",
    "Instances preempted so that a bigger instance's KV reservation could grow (LLM-Mesh §7.1)",
)
KV_EVICTIONS = Counter(
    "tessera_engine_kv_evictions_total",
    "Requests evicted from a KV cache the node could not grow (LLM-Mesh §6.4): resumed elsewhere",
)
KV_UNDERESTIMATES = Counter(
    "tessera_engine_kv_underestimates_total",
    "Requests that outgrew their instance's KV reservation when the node could not grow it "
    "(the runtime allocates on demand: the node is then over its optimistic budget)",
)
GATE_WAIT = Histogram(
    "tessera_engine_gate_wait_seconds",
    "Seconds a request's iterations waited for the node's headroom gate (another instance's "
    "more urgent iterations ran meanwhile)",
    buckets=(0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16),
)
TTFT = Histogram(
    "tessera_engine_ttft_seconds",
    "Generate received to first token, in the engine",
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8),
)


def forget_kv_gauges(model: str) -> None:
    for gauge in (KV_RESERVED, KV_ALLOCATED):
        try:
            gauge.remove(model)
        except KeyError:
            pass

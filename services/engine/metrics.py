"""The engine's Prometheus metrics (served on its /metrics)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

_SECONDS = (0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32)

PHASE_SECONDS = Histogram(
    "tessera_coldstart_phase_seconds", "Seconds in each cold start phase", ["phase"], buckets=_SECONDS
)
COLD_START_SECONDS = Histogram(
    "tessera_coldstart_seconds", "Start request to first token of the request that caused it", buckets=_SECONDS[2:]
)
DECODED_TOKENS = Counter("tessera_engine_decoded_tokens_total", "Tokens decoded by this engine")
REQUESTS = Counter("tessera_engine_requests_total", "Generations ended", ["finish_reason"])
INSTANCES = Gauge("tessera_engine_instances", "Model instances serving on this engine")
PIPELINED = Gauge(
    "tessera_engine_pipelined_instances", "Instances served through a pipeline until their replica is whole"
)
STAGE_WORKERS = Gauge("tessera_engine_stage_workers", "Workers running a pipeline stage for other nodes")
RESIDENT_BYTES = Gauge("tessera_engine_resident_model_bytes", "Weight bytes of bound workers, in use or not")
POOL_IDLE_BYTES = Gauge("tessera_engine_pool_idle_bytes", "Weight bytes kept resident with no instance (reusable)")
POOL_HITS = Counter("tessera_engine_pool_hits_total", "Starts that found their model resident")
POOL_EVICTIONS = Counter("tessera_engine_pool_evictions_total", "Resident models evicted")
ARENA_BYTES = Gauge("tessera_engine_arena_bytes", "Tensor bytes in the node's arena, held or idle", ["state"])
ARENA_LOADS = Counter(
    "tessera_engine_arena_load_bytes_total", "Tensor bytes bound in the node's arena: copied in or reused", ["how"]
)
ARENA_STREAMED = Counter(
    "tessera_engine_arena_streamed_bytes_total", "Arena bytes copied after the start was admitted (TIDAL streaming)"
)
PREWARMED = Gauge("tessera_engine_prewarmed_workers", "Worker processes warm and bound to no model")
PREWARMED_BYTES = Gauge("tessera_engine_prewarmed_rss_bytes", "Resident memory of the pre-warmed workers")
UNACCOUNTED_BYTES = Gauge(
    "tessera_engine_unaccounted_bytes", "Memory bound workers hold beyond their grants (a refused true-up)"
)
WORKER_RSS_BYTES = Gauge("tessera_engine_bound_workers_rss_bytes", "Resident memory of workers bound to models")
COLD_WORKERS = Counter("tessera_engine_unwarmed_starts_total", "Starts that found no pre-warmed worker")
INSTANCE_EVICTIONS = Counter("tessera_engine_instance_evictions_total", "Idle instances ended early to make room")
REIMPORTS = Counter("tessera_engine_reimports_total", "Starts that imported a blob again after a failed block check")
BOUND_BY_TIER = Gauge("tessera_engine_bound_workers", "Workers bound to a model, by compiled tier", ["tier"])
TIER_UPS = Counter("tessera_engine_tier_ups_total", "Workers that swapped START for STEADY", ["result"])
TIER_UP_SECONDS = Histogram("tessera_engine_tier_up_seconds", "Seconds a background tier-up took", buckets=_SECONDS[3:])
QUEUE_WAIT = Histogram("tessera_engine_queue_wait_seconds", "Generate received to its run starting", buckets=_SECONDS)
BATCHED_REQUESTS = Counter("tessera_engine_batched_requests_total", "Requests run, by their batch's size", ["batch"])
KV_RESERVED = Gauge("tessera_engine_kv_reserved_bytes", "KV bytes reserved per model (LLM-Mesh eq. 2)", ["model"])
KV_ALLOCATED = Gauge("tessera_engine_kv_allocated_bytes", "KV bytes the core has allocated per model", ["model"])
KV_RESIZES = Counter("tessera_engine_kv_resizes_total", "KV reservations resized by the watermark rule", ["direction"])
PREEMPTIONS = Counter("tessera_engine_preemptions_total", "Instances preempted for a bigger one's KV (LLM-Mesh §7.1)")
KV_EVICTIONS = Counter(
    "tessera_engine_kv_evictions_total", "Requests evicted from a KV cache that could not grow (§6.4)"
)
KV_UNDERESTIMATES = Counter(
    "tessera_engine_kv_underestimates_total", "Requests that outgrew a KV reservation the node could not grow"
)
GATE_WAIT = Histogram(
    "tessera_engine_gate_wait_seconds", "Seconds a request's iterations waited for the headroom gate", buckets=_SECONDS
)
TTFT = Histogram(
    "tessera_engine_ttft_seconds",
    "Generate received to first token, in the engine",
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8),
)


ADAPTER_REQUESTS = Counter("tessera_engine_adapter_requests_total", "Requests served with a LoRA adapter", ["adapter"])
ADAPTER_LOADS = Counter("tessera_engine_adapter_loads_total", "LoRA adapters loaded on an instance (adapter starts)")
ADAPTER_DROPS = Counter("tessera_engine_adapter_drops_total", "LoRA adapters dropped when idle their keep-alive")

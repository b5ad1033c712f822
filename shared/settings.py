"""Settings shared by every service; each service extends `CommonSettings` once.

Every value comes from a `TESSERA_*` environment variable. Only a service's `__main__` builds
its settings object; everything else receives it as an argument.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic_settings import BaseSettings, SettingsConfigDict


class CommonSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TESSERA_", extra="ignore")

    nats_url: str = "nats://127.0.0.1:4222"
    """Where the bus is; nats-py reconnects here forever when it is lost."""
    redis_url: str = "redis://127.0.0.1:6379/0"
    """The Valkey (Redis-compatible) server holding registry, cold-start log and state."""
    http_host: str = "127.0.0.1"
    http_port: int = 0
    """Port of this service's /healthz, /readyz, /metrics (the gateway also serves its API here)."""
    log_level: str = "INFO"
    node_id: str = "node-0"
    """Name of the node this process belongs to (engine, loader and memory manager are per node)."""
    model_store: Path = Path(".tessera/store")
    """Directory of imported model artifacts, shared by loader, engine and gateway."""
    request_timeout_s: float = 5.0
    """Default timeout of a bus request/reply; long operations set their own."""
    device: str = "CPU"
    """OpenVINO device of this node's engine; artifacts are materialized for it."""
    inference_threads: int = 2
    """OpenVINO inference threads per instance; part of the materialized compile config."""
    engine_backend: Literal["openvino", "torch", "vllm"] = "openvino"
    """What runs a node's models: OpenVINO GenAI, the torch engine (transformers' model code
    over the tensor arena, `services/engine/torch_engine`), or vLLM (`services/engine/
    vllm_engine`: where the `vllm` package is installed, on a GPU or vLLM's CPU backend). One
    setting for the node's loader, which materializes a torch checkpoint at registration for
    `torch` and `vllm` (`shared.artifact.reads_torch_checkpoint`), and its engine."""
    kv_min_tokens: int = 0
    """L_min of LLM-Mesh's eq. 2: the fewest tokens an instance's KV reservation covers (it
    grows with the requests running, by the watermark rule). 0: the model's context length,
    as the paper sets it, where the engine's cache is allocated whole; none where it grows as
    its rows fill (OpenVINO: `policy.kv_watermark.floor_tokens`). The scheduler places
    instances at this size, the engine reserves it."""
    kv_watermark: float = 0.2
    """w of §6.2: a KV reservation grows to 1 + w times what its requests need, and shrinks
    only once that is w below what it holds."""
    heartbeat_interval_s: float = 0.5
    node_timeout_s: float = 3.0
    """A node whose heartbeat is older than this is taken for dead: its streams fail, it gets no work."""

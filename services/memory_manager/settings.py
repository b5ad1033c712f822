from __future__ import annotations

from shared.settings import CommonSettings


class MemoryManagerSettings(CommonSettings):
    http_port: int = 8102
    memory_budget_bytes: int = 8 * 1024**3
    """Bytes this node may give to model weights and KV caches."""

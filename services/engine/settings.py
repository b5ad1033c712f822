from __future__ import annotations

from shared.settings import CommonSettings


class EngineSettings(CommonSettings):
    http_port: int = 8104
    max_concurrent_generations: int = 4
    """Threads running generations at once across instances of this node."""
    memory_request_timeout_s: float = 5.0
    pool_budget_bytes: int = 2 * 1024**3
    """Bytes of compiled models kept resident after their instances scaled to zero."""
    stream_interval_s: float = 0.03
    """Text produced within this interval travels as one message (the first piece at once)."""

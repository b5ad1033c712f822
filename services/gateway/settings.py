from __future__ import annotations

from shared.settings import CommonSettings


class GatewaySettings(CommonSettings):
    http_port: int = 8000
    max_inflight: int = 64
    """Requests admitted at once by this gateway; past it, 429 with Retry-After."""
    placement_timeout_s: float = 300.0
    """Longest a request waits for a placement, a cold start included."""
    stream_idle_timeout_s: float = 300.0
    """Longest gap between two tokens of a live engine before the request fails."""
    liveness_check_s: float = 0.5
    import_timeout_s: float = 600.0
    max_body_bytes: int = 4 * 1024 * 1024
    auth: bool = True
    """Require an API key (`Authorization: Bearer`) on /v1 and the admin key on /admin;
    TESSERA_AUTH=off runs open (health and metrics are always open)."""
    admin_key: str = ""
    """Guards /admin/* (and may call /v1 without limits); generated and logged when empty.
    Replicas behind one load balancer must share it."""

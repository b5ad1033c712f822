from __future__ import annotations

from shared.settings import CommonSettings


class GatewaySettings(CommonSettings):
    http_port: int = 8000
    max_inflight: int = 256
    """Requests admitted at once by this gateway (placed, running or queued on an engine: the
    continuous-batching core runs up to 256 at once); past it, requests wait in line."""
    max_waiting: int = 1024
    """Requests waiting in line for admission; past it, 429 with Retry-After at once."""
    queue_slo_multiple: float = 5.0
    """How long a request may wait in line: this many times its TTFT SLO (its model's, grown to
    its prompt: `policy.slo.ttft_slo`; then 429 with Retry-After: it would be that late anyway)."""
    placement_timeout_s: float = 300.0
    """Longest a request waits for a placement, a cold start included."""
    stream_idle_timeout_s: float = 300.0
    """Longest gap between two tokens of a live engine before the request fails."""
    liveness_check_s: float = 0.5
    import_timeout_s: float = 600.0
    max_body_bytes: int = 4 * 1024 * 1024
    request_head_timeout_s: float = 20.0
    """Longest a client may take to send a request's head (line and headers), from connecting
    or from the first byte of a later request on the connection; then 408 and closed. Bounds
    slowloris; a head is a few hundred bytes (Apache's mod_reqtimeout allows 20 s at first)."""
    auth: bool = True
    """Require an API key (`Authorization: Bearer`) on /v1 and the admin key on /admin;
    TESSERA_AUTH=off runs open (health and metrics are always open)."""
    admin_key: str = ""
    """Guards /admin/* (and may call /v1 without limits); generated and logged when empty.
    Replicas behind one load balancer must share it."""

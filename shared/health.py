"""Per-service HTTP: /healthz (alive), /readyz (dependencies reachable), /metrics (Prometheus).

The gateway mounts these routes into its API; every other service serves them alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Sequence

import uvicorn
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

Check = Callable[[], Awaitable[bool]]

log = logging.getLogger(__name__)


class Readiness:
    """Named checks; ready only when every one passes. Each check is bounded in time."""

    def __init__(self, service: str) -> None:
        self.service = service
        self.checks: dict[str, Check] = {}

    def add(self, name: str, check: Check) -> None:
        self.checks[name] = check

    async def report(self) -> tuple[bool, dict[str, bool]]:
        async def run(check: Check) -> bool:
            try:
                return await asyncio.wait_for(check(), timeout=1.0)
            except Exception:
                return False

        results = await asyncio.gather(*(run(c) for c in self.checks.values()))
        checks = dict(zip(self.checks, results, strict=True))
        return all(results), checks


def health_routes(readiness: Readiness) -> list[BaseRoute]:
    async def healthz(_: Request) -> Response:
        return JSONResponse({"status": "ok", "service": readiness.service})

    async def readyz(_: Request) -> Response:
        ok, checks = await readiness.report()
        return JSONResponse(
            {"ready": ok, "service": readiness.service, "checks": checks},
            status_code=200 if ok else 503,
        )

    async def metrics(_: Request) -> Response:
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    return [
        Route("/healthz", healthz),
        Route("/readyz", readyz),
        Route("/metrics", metrics),
    ]


def health_app(readiness: Readiness, extra: Sequence[BaseRoute] = ()) -> Starlette:
    return Starlette(routes=[*health_routes(readiness), *extra])


def http_server(app: object, host: str, port: int) -> uvicorn.Server:
    """A uvicorn server to run inside the service's own loop (`await server.serve()`)."""
    config = uvicorn.Config(
        app,  # type: ignore[arg-type]
        host=host,
        port=port,
        log_config=None,
        access_log=False,
        lifespan="off",
        timeout_graceful_shutdown=2,
    )
    server = uvicorn.Server(config)
    # The service owns SIGINT/SIGTERM (`shared.runtime`); uvicorn must not take them.
    server.capture_signals = contextlib.nullcontext  # type: ignore[method-assign]
    return server

"""Per-service HTTP: /healthz (alive), /readyz (dependencies reachable), /metrics (Prometheus).

The gateway mounts these routes into its API; every other service serves them alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass

import uvicorn
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

Check = Callable[[], Awaitable[bool]]

CHECK_TIMEOUT_S = 1.0
"""Longest one readiness check may take: a probe must answer well within its own timeout."""

log = logging.getLogger(__name__)


class NotReady(Exception):
    """Raised by a check that can say what is missing right now (its message says it)."""


@dataclass(frozen=True)
class ReadinessReport:
    ready: bool
    checks: dict[str, bool]
    missing: list[str]
    """One line per failing check, "<name>: <what is missing>": an operator reads why at once."""


class Readiness:
    """Named checks; ready only when every one passes. Each check is bounded in time."""

    def __init__(self, service: str) -> None:
        self.service = service
        self.checks: dict[str, Check] = {}
        self.missing: dict[str, str] = {}

    def add(self, name: str, check: Check, missing: str = "check failed") -> None:
        """`missing`: what it means when `check` answers False (it may raise `NotReady` instead)."""
        self.checks[name] = check
        self.missing[name] = missing

    async def report(self) -> ReadinessReport:
        async def run(name: str, check: Check) -> str | None:
            """None when the check passes, else why not."""
            try:
                ok = await asyncio.wait_for(check(), timeout=CHECK_TIMEOUT_S)
            except NotReady as e:
                return str(e)
            except TimeoutError:
                return f"no answer within {CHECK_TIMEOUT_S:g}s"
            except Exception as e:
                return f"{type(e).__name__}: {e}"
            return None if ok else self.missing[name]

        reasons = await asyncio.gather(*(run(n, c) for n, c in self.checks.items()))
        failed = {n: r for n, r in zip(self.checks, reasons, strict=True) if r is not None}
        return ReadinessReport(
            ready=not failed,
            checks={n: n not in failed for n in self.checks},
            missing=[f"{n}: {r}" for n, r in failed.items()],
        )


def health_routes(readiness: Readiness) -> list[BaseRoute]:
    async def healthz(_: Request) -> Response:
        return JSONResponse({"status": "ok", "service": readiness.service})

    async def readyz(_: Request) -> Response:
        report = await readiness.report()
        return JSONResponse(
            {
                "ready": report.ready,
                "service": readiness.service,
                "checks": report.checks,
                "missing": report.missing,
            },
            status_code=200 if report.ready else 503,
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


def http_server(app: object, host: str, port: int, http: type[asyncio.Protocol] | str = "auto") -> uvicorn.Server:
    """A uvicorn server to run inside the service's own loop (`await server.serve()`); `http`:
    its HTTP protocol (the gateway's guards its connections: `services.gateway.connection`)."""
    config = uvicorn.Config(
        app,  # type: ignore[arg-type]
        host=host,
        port=port,
        http=http,
        log_config=None,
        access_log=False,
        lifespan="off",
        timeout_graceful_shutdown=2,
    )
    return _Server(config)


class _Server(uvicorn.Server):
    """The service owns SIGINT/SIGTERM (`shared.runtime`); uvicorn must not take them."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

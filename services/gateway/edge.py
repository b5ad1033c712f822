"""HTTP plumbing of the gateway, apart from its routes: the body limit, errors mapped to
OpenAI's error body, who is calling (the auth dependencies), and the race between a request's
work and its client leaving."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Coroutine
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import Counter
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from services.gateway.auth import ApiError, Auth, Principal
from services.gateway.openai_format import error_body
from services.gateway.protocol import UnsupportedParameter
from services.gateway.ratelimit import retry_after_header
from services.gateway.serving import REJECTED
from shared.errors import TesseraError

log = logging.getLogger(__name__)

CLIENT_GONE = Counter(
    "tessera_gateway_client_disconnects_total",
    "Requests whose client went away before its answer was ready (cancelled)",
)


def error_response(
    status: int,
    message: str,
    code: str | None,
    param: str | None = None,
    retry_after_s: float | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    headers = dict(headers or {})
    if retry_after_s is not None:
        # Whole seconds rounded up (RFC 9110), and OpenAI's exact `retry-after-ms` beside it,
        # which its clients read first.
        headers["Retry-After"] = str(retry_after_header(retry_after_s))
        headers["retry-after-ms"] = str(max(1, round(retry_after_s * 1000)))
    return JSONResponse(error_body(status, message, code, param), status_code=status, headers=headers)


class BodyLimit:
    """Refuse bodies over the limit before reading them whole (413, OpenAI error body)."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            too_large = error_response(413, f"request body is over {self.max_bytes} bytes", "body_too_large")
            length = dict(scope["headers"]).get(b"content-length")
            if length is not None and length.isdigit() and int(length) > self.max_bytes:
                await too_large(scope, receive, send)
                return
            if length is None:
                # No length given (chunked): read it here, up to the limit, then hand it on.
                messages: list[Message] = []
                size = 0
                while True:
                    message = await receive()
                    messages.append(message)
                    if message["type"] != "http.request":
                        break
                    size += len(message.get("body", b""))
                    if size > self.max_bytes:
                        await too_large(scope, receive, send)
                        return
                    if not message.get("more_body", False):
                        break
                receive = _replay(messages, receive)
        await self.app(scope, receive, send)


def _replay(messages: list[Message], receive: Receive) -> Receive:
    async def replayed() -> Message:
        return messages.pop(0) if messages else await receive()

    return replayed


def handle_errors(app: FastAPI) -> None:
    """Every error an OpenAI error body: ours, validation's (naming the parameter), Starlette's
    (404, 405), Valkey's (503, retry) and the unexpected (500, logged)."""

    @app.exception_handler(ApiError)
    async def api_error(_: Request, e: ApiError) -> JSONResponse:
        REJECTED.labels(e.code).inc()
        return error_response(e.status, e.message, e.code, e.param, e.retry_after_s, e.headers)

    @app.exception_handler(TesseraError)
    async def tessera_error(_: Request, e: TesseraError) -> JSONResponse:
        return error_response(e.status, e.message, e.code.value, e.param, e.retry_after_s)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, e: RequestValidationError) -> JSONResponse:
        first = e.errors()[0] if e.errors() else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        where = ".".join(loc)
        cause = (first.get("ctx") or {}).get("error")
        if isinstance(cause, UnsupportedParameter):  # raised by the whole body's check: no loc
            return error_response(400, str(cause), "unsupported_parameter", cause.param)
        msg = first.get("msg", "invalid request")
        return error_response(400, f"{where}: {msg}" if where else msg, "invalid_request", where or None)

    @app.exception_handler(StarletteHTTPException)
    async def http(_: Request, e: StarletteHTTPException) -> JSONResponse:
        return error_response(e.status_code, str(e.detail), None)

    @app.exception_handler(RedisConnectionError)
    @app.exception_handler(RedisTimeoutError)
    async def state_down(_: Request, e: Exception) -> JSONResponse:
        log.warning("Valkey unreachable: %s", e)
        return error_response(503, "the state store is unreachable; retry shortly", "unavailable", retry_after_s=2)

    @app.exception_handler(Exception)
    async def crash(_: Request, e: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return error_response(500, "internal error", "internal_error")


async def caller(request: Request) -> Principal:
    auth: Auth = request.app.state.auth
    return await auth.principal(request)


async def admin_caller(request: Request) -> Principal:
    auth: Auth = request.app.state.auth
    return await auth.admin(request)


Caller = Annotated[Principal, Depends(caller)]
"""An API caller (its key's limits and models), for a route's parameters."""


async def _disconnected(request: Request) -> None:
    """Returns once the client has gone (the body is read by then, so the next ASGI message is
    the disconnect: vLLM's `listen_for_disconnect`)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, work: Coroutine[Any, Any, Response]) -> Response:
    """`work`, cancelled if the client goes away first: a request waiting in line, starting a
    model or generating a non-streamed answer stops (its engine aborts it within a step),
    instead of running on for nobody. A streamed answer's own disconnects are Starlette's."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        CLIENT_GONE.inc()
        return Response(status_code=499)  # nobody reads it: nginx's "client closed request"
    return task.result()

"""HTTP routes of the gateway: the OpenAI API, the admin API, health. Thin: logic lives in
`serving` (requests), `admin` (registrations, keys) and `auth` (keys, quotas).

/v1 needs an API key, /admin the admin key (unless auth is off); health and metrics are open."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Coroutine
from typing import Annotated, Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import Counter
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from services.gateway import choices
from services.gateway.admin import Admin
from services.gateway.auth import ApiError, Auth, Principal, Quotas, check_model
from services.gateway.openai_format import Shape, error_body
from services.gateway.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    CreateApiKey,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    RegisterModel,
    ScaleModel,
    TokenizeRequest,
    TokenizeResponse,
    UnsupportedParameter,
)
from services.gateway.ratelimit import retry_after_header
from services.gateway.responses import responses_router
from services.gateway.serving import REJECTED, Gateway
from services.gateway.ui import ui_router
from shared.errors import TesseraError
from shared.health import Readiness, health_routes

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
        headers["Retry-After"] = str(max(1, round(retry_after_s)))
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


def create_app(gateway: Gateway, admin: Admin, readiness: Readiness) -> FastAPI:
    # Ready: its own NATS and Valkey checks (`shared.runtime`), and an engine to serve on.
    readiness.add("engine", gateway.engines_heard)
    app = FastAPI(title="Tessera", version="0.1.0", routes=health_routes(readiness))
    app.add_middleware(BodyLimit, max_bytes=gateway.settings.max_body_bytes)
    auth = Auth(gateway.settings, admin.keys)
    quotas = Quotas(admin.keys)
    app.state.auth = auth

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, e: ApiError) -> JSONResponse:
        REJECTED.labels(e.code).inc()
        retry = None if e.retry_after_s is None else retry_after_header(e.retry_after_s)
        return error_response(e.status, e.message, e.code, e.param, retry, e.headers)

    @app.exception_handler(TesseraError)
    async def _tessera_error(_: Request, e: TesseraError) -> JSONResponse:
        return error_response(e.status, e.message, e.code.value, e.param, e.retry_after_s)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, e: RequestValidationError) -> JSONResponse:
        first = e.errors()[0] if e.errors() else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        where = ".".join(loc)
        cause = (first.get("ctx") or {}).get("error")
        if isinstance(cause, UnsupportedParameter):  # raised by the whole body's check: no loc
            return error_response(400, str(cause), "unsupported_parameter", cause.param)
        msg = first.get("msg", "invalid request")
        return error_response(400, f"{where}: {msg}" if where else msg, "invalid_request", where or None)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, e: StarletteHTTPException) -> JSONResponse:
        return error_response(e.status_code, str(e.detail), None)

    @app.exception_handler(RedisConnectionError)
    @app.exception_handler(RedisTimeoutError)
    async def _state_down(_: Request, e: Exception) -> JSONResponse:
        log.warning("Valkey unreachable: %s", e)
        return error_response(503, "the state store is unreachable; retry shortly", "unavailable", retry_after_s=2)

    @app.exception_handler(Exception)
    async def _crash(_: Request, e: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return error_response(500, "internal error", "internal_error")

    @app.get("/v1/models")
    async def list_models(who: Caller) -> ModelList:
        records = await gateway.registry.all()
        return ModelList(data=[ModelCard(id=r.name, created=int(r.created_at)) for r in records if who.may_use(r.name)])

    @app.get("/v1/models/{name:path}")
    async def get_model(name: str, who: Caller) -> ModelCard:
        check_model(who, name)
        r = await gateway.model(name)
        return ModelCard(id=r.name, created=int(r.created_at))

    @app.post("/v1/chat/completions", response_model=None)
    async def chat(req: ChatCompletionRequest, who: Caller, request: Request) -> Response:
        return await _unless_disconnected(request, _complete(gateway, quotas, who, req, chat=True))

    @app.post("/v1/completions", response_model=None)
    async def completions(req: CompletionRequest, who: Caller, request: Request) -> Response:
        return await _unless_disconnected(request, _complete(gateway, quotas, who, req, chat=False))

    # vLLM's shape and paths (at the root, not under /v1): ids for logit_bias, counting a
    # prompt against the context before sending it.
    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest, who: Caller) -> TokenizeResponse:
        check_model(who, req.model)
        return await gateway.tokenize(req)

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest, who: Caller) -> DetokenizeResponse:
        check_model(who, req.model)
        return await gateway.detokenize(req)

    app.include_router(responses_router(gateway, quotas))
    app.include_router(_admin_routes(admin))
    app.include_router(ui_router(admin, _admin_caller))
    return app


async def _caller(request: Request) -> Principal:
    auth: Auth = request.app.state.auth
    return await auth.principal(request)


async def _admin_caller(request: Request) -> Principal:
    auth: Auth = request.app.state.auth
    return await auth.admin(request)


Caller = Annotated[Principal, Depends(_caller)]


def _admin_routes(admin: Admin) -> APIRouter:
    router = APIRouter(prefix="/admin", dependencies=[Depends(_admin_caller)])

    @router.post("/models", status_code=201)
    async def register(req: RegisterModel) -> dict[str, object]:
        return await admin.register(req)

    @router.get("/models")
    async def models() -> list[dict[str, object]]:
        return await admin.list()

    @router.post("/models/{name:path}/scale")
    async def scale(name: str, req: ScaleModel) -> dict[str, object]:
        return await admin.scale(name, req.instances)

    @router.delete("/models/{name:path}")
    async def remove(name: str) -> dict[str, object]:
        return await admin.remove(name)

    @router.post("/keys", status_code=201)
    async def create_key(req: CreateApiKey) -> dict[str, object]:
        return await admin.create_key(req)

    @router.get("/keys")
    async def keys() -> list[dict[str, object]]:
        return await admin.list_keys()

    @router.delete("/keys/{name}")
    async def delete_key(name: str) -> dict[str, object]:
        return await admin.delete_key(name)

    @router.get("/coldstarts")
    async def cold_starts(limit: int = 50) -> list[dict[str, object]]:
        return await admin.cold_starts(max(1, min(limit, 200)))

    @router.post("/cache/evict")
    async def evict(tier: str = "resident", artifact_id: str = "") -> list[dict[str, object]]:
        return await admin.evict(tier, artifact_id)

    @router.get("/instances")
    async def instances() -> dict[str, object]:
        return await admin.instances()

    @router.get("/cache")
    async def cache() -> list[dict[str, object]]:
        return await admin.cache()

    return router


async def _disconnected(request: Request) -> None:
    """Returns once the client has gone (the body is read by then, so the next ASGI message is
    the disconnect: vLLM's `listen_for_disconnect`)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(request: Request, work: Coroutine[Any, Any, Response]) -> Response:
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


async def _complete(
    gateway: Gateway, quotas: Quotas, who: Principal, req: ChatCompletionRequest | CompletionRequest, chat: bool
) -> JSONResponse | StreamingResponse:
    check_model(who, req.model)
    legs = choices.legs_of(req, await gateway.prepare_all(req))
    await choices.open_legs(gateway, quotas, who, legs)
    first = legs[0].gen
    assert first is not None
    shape = Shape(chat, first.request_id, legs[0].prepared.record.name)
    if req.stream:
        return StreamingResponse(
            choices.stream(gateway, req, shape, legs, quotas),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    try:
        return JSONResponse(await choices.answer(gateway, req, shape, legs))
    finally:
        await choices.close_legs(quotas, legs)

"""HTTP routes of the gateway: the OpenAI API, the admin API, health. Thin: the completion path
is `completion` (its shapes `choices` and `responses`), the rest of the logic `serving`
(tokenizing, placing), `admin` (registrations, keys) and `auth` (keys, quotas); the HTTP
plumbing (body limit, errors, callers, client disconnects) is `edge`.

/v1 needs an API key, /admin the admin key (unless auth is off); health and metrics are open."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Body, Depends, FastAPI, Request
from fastapi.responses import Response

from services.gateway.adapters import adapter_card, model_cards
from services.gateway.admin import Admin, as_json
from services.gateway.auth import Auth, Quotas, check_model
from services.gateway.choices import Choices
from services.gateway.cold import MAX_WAIT_HEADER
from services.gateway.completion import complete
from services.gateway.edge import BodyLimit, Caller, admin_caller, handle_errors, unless_disconnected
from services.gateway.loading import cluster_states
from services.gateway.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    CreateApiKey,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    PinModel,
    RegisterAdapter,
    RegisterModel,
    ScaleModel,
    TokenizeRequest,
    TokenizeResponse,
)
from services.gateway.responses import ResponsesRequest, respond
from services.gateway.serving import Gateway
from services.gateway.ui import ui_router
from shared.health import Readiness, health_routes
from shared.routing_messages import ModelAlias


def create_app(gateway: Gateway, admin: Admin, readiness: Readiness) -> FastAPI:
    # Ready: its own NATS and Valkey checks (`shared.runtime`), and an engine to serve on.
    readiness.add("engine", gateway.engines_heard)
    app = FastAPI(title="Tessera", version="0.1.0", routes=health_routes(readiness))
    app.add_middleware(BodyLimit, max_bytes=gateway.settings.max_body_bytes)
    auth = Auth(gateway.settings, admin.keys)
    quotas = Quotas(admin.keys)
    app.state.auth = auth

    handle_errors(app)

    # Models, then aliases (their members as `fallbacks`, Tessera's extension field).
    @app.get("/v1/models")
    async def list_models(who: Caller) -> ModelList:
        states = await cluster_states(gateway.bus, gateway.settings.request_timeout_s)
        cards = await model_cards(gateway.registry, who, states)
        cards += [alias_card(a) for a in await gateway.registry.aliases() if who.may_use(a.name)]
        return ModelList(data=cards)

    @app.get("/v1/models/{name:path}")
    async def get_model(name: str, who: Caller) -> ModelCard:
        check_model(who, name)
        if (alias := await gateway.registry.alias(name)) is not None:
            return alias_card(alias)
        states = await cluster_states(gateway.bus, gateway.settings.request_timeout_s)
        if (adapter := await gateway.registry.get_adapter(name)) is not None:
            return adapter_card(adapter, None if states is None else states.get(adapter.base, "cold"))
        r = await gateway.model(name)
        status = None if states is None else states.get(r.name, "cold")
        return ModelCard(id=r.name, created=int(r.created_at), root=r.name, status=status)

    # One completion path (`completion.complete`); each API its own shape of the answer. The
    # cold-start budget's header goes with it.
    @app.post("/v1/chat/completions", response_model=None)
    async def chat(req: ChatCompletionRequest, who: Caller, request: Request) -> Response:
        wait = request.headers.get(MAX_WAIT_HEADER)
        return await unless_disconnected(request, complete(gateway, quotas, who, req, Choices.of(gateway, req), wait))

    @app.post("/v1/completions", response_model=None)
    async def completions(req: CompletionRequest, who: Caller, request: Request) -> Response:
        wait = request.headers.get(MAX_WAIT_HEADER)
        return await unless_disconnected(request, complete(gateway, quotas, who, req, Choices.of(gateway, req), wait))

    @app.post("/v1/responses", response_model=None)
    async def create_response(req: ResponsesRequest, who: Caller, request: Request) -> Response:
        wait = request.headers.get(MAX_WAIT_HEADER)
        return await unless_disconnected(request, respond(gateway, quotas, who, req, wait))

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

    app.include_router(_admin_routes(admin))
    app.include_router(ui_router(admin, admin_caller))
    return app


def alias_card(alias: ModelAlias) -> ModelCard:
    return ModelCard(id=alias.name, created=int(alias.created_at), fallbacks=list(alias.members))


def _admin_routes(admin: Admin) -> APIRouter:
    router = APIRouter(prefix="/admin", dependencies=[Depends(admin_caller)])

    @router.post("/models", status_code=201)
    async def register(req: RegisterModel) -> dict[str, object]:
        return await admin.register(req)

    @router.get("/models")
    async def models() -> list[dict[str, object]]:
        return await admin.list()

    @router.get("/aliases")
    async def aliases() -> list[dict[str, object]]:
        return await admin.list_aliases()

    @router.post("/models/{name:path}/scale")
    async def scale(name: str, req: ScaleModel) -> dict[str, object]:
        return await admin.scale(name, req.instances)

    # Keep warm (issue 35): the body is optional, `{}` or none pins one instance.
    @router.post("/models/{name:path}/pin")
    async def pin(name: str, req: Annotated[PinModel | None, Body()] = None) -> dict[str, object]:
        req = req or PinModel()
        return await admin.pin(name, req.min_instances, req.priority)

    @router.post("/models/{name:path}/unpin")
    async def unpin(name: str) -> dict[str, object]:
        return await admin.unpin(name)

    # Before `/models/{name:path}`, which would take `<base>/adapters/<name>` for a model name.
    @router.post("/models/{base:path}/adapters", status_code=201)
    async def register_adapter(base: str, req: RegisterAdapter) -> dict[str, object]:
        return as_json(await admin.adapters.register(base, req))

    @router.get("/models/{base:path}/adapters")
    async def adapters(base: str) -> list[dict[str, object]]:
        return [as_json(a) for a in await admin.adapters.of(base)]

    @router.delete("/models/{base:path}/adapters/{name:path}")
    async def remove_adapter(base: str, name: str) -> dict[str, object]:
        return await admin.adapters.remove(base, name)

    @router.get("/models/{name:path}")
    async def model(name: str) -> dict[str, object]:
        return await admin.get(name)

    @router.delete("/models/{name:path}")
    async def remove(name: str, cascade: bool = False) -> dict[str, object]:
        return await admin.remove(name, cascade)

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

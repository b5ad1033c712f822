"""LoRA adapters at the gateway (issue 34): their registration on a registered base (the
loader checks and keeps them: `services/loader/adapters.py`), their listing beside the models
(`/v1/models`, with `parent` as vLLM gives it). A request that names one is served on its base
(`fallbacks.candidates`, `Generate.adapter`)."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from services.gateway.auth import ApiError, Principal
from services.gateway.protocol import ModelCard, ModelState, RegisterAdapter
from services.gateway.settings import GatewaySettings
from shared import subjects
from shared.adapters import AdapterImported, AdapterRecord, ImportAdapter
from shared.bus import Bus
from shared.errors import TesseraError
from shared.messages import ErrorCode, ModelRecord, Rejected
from shared.registry import AdapterPut, Registry


def name_taken(name: str, by: str) -> ApiError:
    return ApiError(
        409,
        f"the name `{name}` is taken by a registered {by}; models and adapters share one namespace",
        "model_exists",
        param="name",
    )


class AdapterAdmin:
    def __init__(
        self,
        settings: GatewaySettings,
        bus: Bus,
        registry: Registry,
        fits: Callable[[ModelRecord, AdapterRecord | None], Awaitable[None]],
    ) -> None:
        """`fits`: refuses a pin the nodes cannot hold (`Admin.fits`)."""
        self.settings = settings
        self.bus = bus
        self.registry = registry
        self.fits = fits

    async def register(self, base: str, req: RegisterAdapter) -> AdapterRecord:
        record = await self.registry.get(base)
        if record is None:
            raise ApiError(
                400, f"the base model `{base}` is not registered: register it first", "base_not_found", param="base"
            )
        await self._free(req.name)
        imported = await self.bus.request(
            subjects.import_adapter(),
            ImportAdapter(base=record, source=req.source),
            AdapterImported | Rejected,
            timeout=self.settings.import_timeout_s,
        )
        if isinstance(imported, Rejected):
            raise TesseraError(imported.code, imported.message, param="source")
        now = await self.registry.get(base)
        if now is not None and now.artifact.artifact_id != record.artifact.artifact_id:
            # Replaced while the loader checked the adapter against it.
            raise ApiError(409, f"the base model `{base}` changed during the registration; retry", "base_changed")
        adapter = AdapterRecord(**req.service_terms(), base=base, adapter=imported.adapter, created_at=time.time())
        if adapter.min_instances > 0:  # before it is stored: the scheduler starts what is stored
            await self.fits(now or record, adapter)
        put = await self.registry.put_adapter_new(adapter)
        if put is AdapterPut.NO_BASE:
            raise ApiError(409, f"the base model `{base}` was removed during the registration", "base_changed")
        if put is not AdapterPut.STORED:
            raise name_taken(req.name, "model" if put is AdapterPut.MODEL_NAME else "adapter")
        return adapter

    async def _free(self, name: str) -> None:
        if await self.registry.get(name) is not None:
            raise name_taken(name, "model")
        if await self.registry.get_adapter(name) is not None:
            raise name_taken(name, "adapter")
        if await self.registry.alias(name) is not None:
            raise name_taken(name, "alias")

    async def of(self, base: str) -> list[AdapterRecord]:
        if await self.registry.get(base) is None:
            raise TesseraError(ErrorCode.MODEL_NOT_FOUND, f"The model `{base}` does not exist.", param="base")
        return await self.registry.adapters(base)

    async def remove(self, base: str, name: str) -> dict[str, Any]:
        adapter = await self.registry.get_adapter(name)
        if adapter is None or adapter.base != base or not await self.registry.remove_adapter(adapter):
            raise TesseraError(ErrorCode.MODEL_NOT_FOUND, f"`{base}` has no adapter `{name}`.", param="name")
        return {"name": name, "base": base, "removed": True}


async def model_cards(
    registry: Registry, who: Principal, states: Mapping[str, ModelState] | None = None
) -> list[ModelCard]:
    """Every model the caller may use, each followed by its adapters (vLLM's `parent`);
    `states`: each running or starting model's `status` (the rest are cold; None: unknown,
    no `status` given)."""
    by_base: dict[str, list[AdapterRecord]] = {}
    for a in await registry.adapters():
        by_base.setdefault(a.base, []).append(a)
    cards = []
    for r in await registry.all():
        status = None if states is None else states.get(r.name, "cold")
        if who.may_use(r.name):
            cards.append(ModelCard(id=r.name, created=int(r.created_at), root=r.name, status=status))
        cards += [adapter_card(a, status) for a in by_base.get(r.name, []) if who.may_use(a.name)]
    return cards


def adapter_card(a: AdapterRecord, status: ModelState | None = None) -> ModelCard:
    """An adapter's card; `status`: its base's (it runs on its base's instance)."""
    return ModelCard(id=a.name, created=int(a.created_at), root=a.base, parent=a.base, status=status)

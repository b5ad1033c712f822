"""Admin API: register, list and remove models; API keys; recent cold starts; where instances
run."""

from __future__ import annotations

import builtins
import time
from typing import Any

import msgspec

from policy import fallbacks, keep_warm
from services.gateway.adapters import AdapterAdmin, name_taken
from services.gateway.auth import ApiError, KeyStore
from services.gateway.protocol import CreateApiKey, RegisterModel
from services.gateway.settings import GatewaySettings
from services.gateway.tokenizers import Tokenizers
from shared import subjects
from shared.adapters import AdapterRecord
from shared.bus import Bus
from shared.cache_messages import CacheQuery, CacheStatus, Evicted, EvictHostCache, EvictResidents
from shared.errors import TesseraError
from shared.messages import (
    Artifact,
    ClusterStatus,
    ClusterStatusQuery,
    ErrorCode,
    GenerationDefaults,
    ImportModel,
    ModelImported,
    ModelRecord,
    Rejected,
    ScaledOut,
    ScaleOut,
)
from shared.registry import Registry
from shared.routing_messages import ModelAlias


def _untagged(value: Any) -> Any:
    # The msgspec tag ("type") is a wire detail, not part of the API.
    if isinstance(value, dict):
        return {k: _untagged(v) for k, v in value.items() if k != "type"}
    if isinstance(value, list):
        return [_untagged(v) for v in value]
    return value


def as_json(obj: msgspec.Struct) -> dict[str, Any]:
    data: dict[str, Any] = _untagged(msgspec.to_builtins(obj))
    return data


def generation_defaults(artifact: Artifact, req: RegisterModel) -> GenerationDefaults:
    """The platform's defaults, overridden by the model's metadata, overridden by the
    registration; the length cap never past the context."""
    chosen: dict[str, Any] = {**artifact.sampling}
    chosen.update(
        {
            k: v
            for k in ("temperature", "top_p", "repetition_penalty", "max_tokens")
            if (v := getattr(req, k)) is not None
        }
    )
    defaults = msgspec.structs.replace(GenerationDefaults(), **chosen)
    return msgspec.structs.replace(defaults, max_tokens=min(defaults.max_tokens, artifact.context_length))


REPLACE = ' or register with "replace": true to replace it'


def _taken(name: str, what: str = "a model", replace: str = REPLACE) -> ApiError:
    """A name taken by a model or an alias (`replace`: how else to free it; "" where the
    other kind holds it, which a registration does not replace)."""
    return ApiError(
        409, f"{what} named `{name}` is already registered; remove it first{replace}", "model_exists", param="name"
    )


def alias_json(alias: ModelAlias) -> dict[str, Any]:
    return {"name": alias.name, "fallbacks": list(alias.members), "created_at": alias.created_at}


class Admin:
    def __init__(
        self, settings: GatewaySettings, bus: Bus, registry: Registry, tokenizers: Tokenizers | None = None
    ) -> None:
        self.settings = settings
        self.bus = bus
        self.registry = registry
        self.tokenizers = tokenizers
        """Renders a registration's chat template once, so that a broken one is a 400 now."""
        self.keys = KeyStore(registry)
        self.adapters = AdapterAdmin(settings, bus, registry, self.fits)

    async def register(self, req: RegisterModel) -> dict[str, Any]:
        if req.fallbacks is not None:
            return await self.register_alias(req.name, req.fallbacks, req.replace)
        assert req.source is not None  # RegisterModel: a source or fallbacks
        if await self.registry.alias(req.name) is not None:
            raise _taken(req.name, "an alias", replace="")
        # Refused before the import (seconds to minutes), and again when stored: another
        # registration of the name may have finished in between.
        if not req.replace and await self.registry.get(req.name) is not None:
            raise _taken(req.name)
        if await self.registry.get_adapter(req.name) is not None:
            raise name_taken(req.name, "adapter")
        imported = await self.bus.request(
            subjects.import_model(),
            ImportModel(source=req.source, weight_format=req.weight_format),
            ModelImported | Rejected,
            timeout=self.settings.import_timeout_s,
        )
        if isinstance(imported, Rejected):
            raise TesseraError(imported.code, imported.message, param="source")
        if req.chat_template and self.tokenizers is not None:
            tok = await self.tokenizers.get(imported.artifact)
            try:
                await self.tokenizers.render_chat(tok, [{"role": "user", "content": "Hi"}], True, req.chat_template)
            except Exception as e:  # the library's Jinja error, whatever its type
                raise TesseraError(
                    ErrorCode.INVALID_REQUEST, f"chat_template does not render: {e}", param="chat_template"
                ) from None
        record = ModelRecord(
            **req.service_terms(),
            artifact=imported.artifact,
            created_at=time.time(),
            defaults=generation_defaults(imported.artifact, req),
            chat_template=req.chat_template,
        )
        await self.fits(record)  # before it is stored: the scheduler starts what is stored
        if req.replace:
            await self._keeps_adapters(record)
            await self.registry.put(record)
        elif not await self.registry.put_new(record):
            raise _taken(req.name)
        return {**as_json(record), "converted": imported.converted, "import_s": imported.seconds}

    # Below this method, `list` in the class body names it, not the builtin: `builtins.list`.
    async def list(self) -> list[dict[str, Any]]:
        return [as_json(r) for r in await self.registry.all()]

    async def get(self, name: str) -> dict[str, Any]:
        return as_json(await self._record(name))

    async def _record(self, name: str) -> ModelRecord:
        record = await self.registry.get(name)
        if record is None:
            raise TesseraError(ErrorCode.MODEL_NOT_FOUND, f"The model `{name}` does not exist.", param="name")
        return record

    async def pin(self, name: str, min_instances: int, priority: int | None) -> dict[str, Any]:
        """Keep `name` warm: `min_instances` instances whatever the traffic (the scheduler starts
        them within a keep-alive pass), at `priority` (None: the one it has). An adapter's pin
        keeps its base's instances, the adapter loaded on them. A 409 (`insufficient_memory`)
        where the nodes cannot hold it beside the other pinned models."""
        if (adapter := await self.registry.get_adapter(name)) is not None:
            pinned_adapter = msgspec.structs.replace(
                adapter, min_instances=min_instances, priority=adapter.priority if priority is None else priority
            )
            await self.fits(await self._record(adapter.base), pinned_adapter)
            return await self._update_adapter(pinned_adapter)
        record = await self._record(name)
        pinned = msgspec.structs.replace(
            record, min_instances=min_instances, priority=record.priority if priority is None else priority
        )
        await self.fits(pinned)
        await self.registry.put(pinned)
        return as_json(pinned)

    async def unpin(self, name: str) -> dict[str, Any]:
        """Scale `name` to zero again after its keep-alive (its priority stays)."""
        if (adapter := await self.registry.get_adapter(name)) is not None:
            return await self._update_adapter(msgspec.structs.replace(adapter, min_instances=0))
        unpinned = msgspec.structs.replace(await self._record(name), min_instances=0)
        await self.registry.put(unpinned)
        return as_json(unpinned)

    async def _update_adapter(self, adapter: AdapterRecord) -> dict[str, Any]:
        if not await self.registry.update_adapter(adapter):
            raise TesseraError(ErrorCode.MODEL_NOT_FOUND, f"The model `{adapter.name}` does not exist.", param="name")
        return as_json(adapter)

    async def fits(self, record: ModelRecord, adapter: AdapterRecord | None = None) -> None:
        """Refuse (409, `insufficient_memory`) a pinned `record` (or `record` as its pinned
        `adapter` keeps it: `keep_warm.with_adapter_pins`) that the live nodes' memory budgets
        cannot hold beside the other pinned models, each at its footprint as the scheduler
        estimates a start's (`keep_warm.need_of`): rather than have them evict one another in
        turn. Nodes that have not told their budget yet: nothing to judge by."""
        adapters = [a for a in await self.registry.adapters() if adapter is None or a.name != adapter.name]
        adapters += [adapter] if adapter else []
        others = [r for r in await self.registry.all() if r.name != record.name]
        everyone = keep_warm.with_adapter_pins([*others, record], adapters)
        record = next(r for r in everyone if r.name == record.name)
        if record.min_instances == 0:
            return
        others = [r for r in everyone if r.name != record.name]
        status = await self.bus.request(
            subjects.cluster_status(), ClusterStatusQuery(), ClusterStatus, timeout=self.settings.request_timeout_s
        )
        told = [n for n in status.nodes if n.memory_budget_bytes > 0]
        if not told:
            return
        budgets, on_demand = [n.memory_budget_bytes for n in told], [n.kv_on_demand for n in told]
        pinned = keep_warm.pinned([*others, record])
        kept = {r.name: sum(a.adapter.nbytes for a in adapters if a.base == r.name and a.min_instances) for r in pinned}
        needs = [keep_warm.need_of(r, self.settings.kv_min_tokens, kept[r.name]) for r in pinned]
        fit = keep_warm.fit(needs, budgets, on_demand)
        if not fit.ok:
            names = ", ".join(f"{r.name} ×{r.min_instances}" for r in pinned)
            raise ApiError(
                409,
                f"the nodes cannot keep every pinned model warm at once ({names}): they need "
                f"{fit.needed_bytes} bytes, and {len(budgets)} node(s) have {fit.available_bytes} bytes available "
                "(at most one instance of a model per node); unpin another model or pin fewer instances",
                "insufficient_memory",
                param="min_instances",
            )

    async def _keeps_adapters(self, record: ModelRecord) -> None:
        """A replacement on other weights would leave the name's adapters checked against
        weights it no longer has: refused while it has any."""
        old = await self.registry.get(record.name)
        if old is None or old.artifact.artifact_id == record.artifact.artifact_id:
            return
        if adapters := await self.registry.adapters(record.name):
            raise ApiError(
                409,
                f"`{record.name}` has adapters ({', '.join(a.name for a in adapters)}) fitted to its current "
                "weights; remove them before replacing it",
                "model_has_adapters",
                param="name",
            )

    async def register_alias(self, name: str, members: builtins.list[str], replace: bool) -> dict[str, Any]:
        """An alias: `members` in order, each a registered model (`policy.fallbacks`)."""
        if await self.registry.get(name) is not None:
            raise _taken(name, "a model", replace="")
        if await self.registry.get_adapter(name) is not None:
            raise name_taken(name, "adapter")
        aliases = {a.name for a in await self.registry.aliases()}
        if name in aliases and not replace:
            raise _taken(name, "an alias")
        models = {r.name for r in await self.registry.all()}
        problem = fallbacks.alias_problem(name, members, models, aliases - {name})
        if problem is not None:
            raise TesseraError(ErrorCode.INVALID_REQUEST, problem, param="fallbacks")
        alias = ModelAlias(name=name, members=tuple(members), created_at=time.time())
        await self.registry.put_alias(alias)
        return alias_json(alias)

    async def list_aliases(self) -> builtins.list[dict[str, Any]]:
        return [alias_json(a) for a in await self.registry.aliases()]

    async def remove(self, name: str, cascade: bool = False) -> dict[str, Any]:
        """Remove an alias; or a model, unless an alias lists it (409 naming the aliases: remove
        or re-register them first, so that no alias changes under its users unseen), and one
        with adapters only with `cascade` (its adapters go too)."""
        if await self.registry.remove_alias(name):
            return {"name": name, "removed": True}
        listed_by = [a.name for a in await self.registry.aliases() if name in a.members]
        if listed_by:
            raise ApiError(
                409,
                f"the model `{name}` is listed by the alias{'es' if len(listed_by) > 1 else ''} "
                f"{', '.join(f'`{a}`' for a in listed_by)}: remove it from them first",
                "model_in_use",
                param="name",
            )
        removal = await self.registry.remove_model(name, cascade)
        if not removal.found:
            raise TesseraError(ErrorCode.MODEL_NOT_FOUND, f"The model `{name}` does not exist.", param="name")
        if not removal.removed:
            raise ApiError(
                409,
                f"`{name}` has adapters ({', '.join(removal.adapters)}): remove them first, or remove all of "
                "them with it (?cascade=true)",
                "model_has_adapters",
                param="name",
            )
        return {"name": name, "removed": True, "adapters_removed": removal.adapters}

    async def scale(self, name: str, instances: int) -> dict[str, Any]:
        """Run the model on `instances` nodes in all: the scheduler starts it at once on the
        nodes missing (one multicast brings its blob to all of them) and answers without
        waiting for them; `/admin/instances` shows them come up."""
        scaled = await self.bus.request(
            subjects.scale_out(),
            ScaleOut(model=name, instances=instances),
            ScaledOut | Rejected,
            timeout=self.settings.request_timeout_s,
        )
        if isinstance(scaled, Rejected):
            param = "name" if scaled.code is ErrorCode.MODEL_NOT_FOUND else "instances"
            raise TesseraError(scaled.code, scaled.message, param=param, retry_after_s=scaled.retry_after_s)
        return as_json(scaled)

    async def create_key(self, req: CreateApiKey) -> dict[str, Any]:
        secret, record = await self.keys.create(req.name, req.models, req.requests_per_minute, req.tokens_per_minute)
        return {**record.public(), "key": secret}

    async def list_keys(self) -> builtins.list[dict[str, Any]]:
        return [r.public() for r in await self.keys.all()]

    async def delete_key(self, name: str) -> dict[str, Any]:
        if not await self.keys.delete(name):
            raise ApiError(404, f"no API key is named `{name}`", "key_not_found", param="name")
        return {"name": name, "deleted": True}

    async def cold_starts(self, limit: int) -> builtins.list[dict[str, Any]]:
        return [as_json(e) for e in await self.registry.cold_starts(limit)]

    async def evict(self, tier: str, artifact_id: str = "") -> builtins.list[dict[str, Any]]:
        """Drop cached models on every live node. `resident`: compiled models kept by idle
        workers (the next start reads the host cache); `host`: also the loaders' host caches;
        `all`: also the store's pages in the OS page cache (the next start reads the disk)."""
        if tier not in ("resident", "host", "all"):
            raise TesseraError(ErrorCode.INVALID_REQUEST, "tier must be resident, host or all", param="tier")
        status = await self.bus.request(
            subjects.cluster_status(),
            ClusterStatusQuery(),
            ClusterStatus,
            timeout=self.settings.request_timeout_s,
        )
        results = []
        for node in status.nodes:
            evicted = await self.bus.request(
                subjects.engine_evict(node.node_id),
                EvictResidents(artifact_id=artifact_id),
                Evicted,
                timeout=self.settings.request_timeout_s,
            )
            results.append({"tier": "resident", **as_json(evicted)})
            if tier != "resident":
                dropped = await self.bus.request(
                    subjects.loader_evict(node.node_id),
                    EvictHostCache(artifact_id=artifact_id, forget_store_pages=tier == "all"),
                    Evicted,
                    timeout=self.settings.request_timeout_s,
                )
                results.append({"tier": "host", **as_json(dropped)})
        return results

    async def cache(self) -> builtins.list[dict[str, Any]]:
        """Each node's host block cache: budget, use and the artifacts in it."""
        status = await self.bus.request(
            subjects.cluster_status(),
            ClusterStatusQuery(),
            ClusterStatus,
            timeout=self.settings.request_timeout_s,
        )
        out: list[dict[str, Any]] = []
        for node in status.nodes:
            try:
                cache = await self.bus.request(
                    subjects.loader_cache(node.node_id),
                    CacheQuery(),
                    CacheStatus,
                    timeout=self.settings.request_timeout_s,
                )
                out.append(as_json(cache))
            except TesseraError as e:  # one silent loader does not hide the others
                out.append({"node_id": node.node_id, "error": e.message})
        return out

    async def instances(self) -> dict[str, Any]:
        status = await self.bus.request(
            subjects.cluster_status(),
            ClusterStatusQuery(),
            ClusterStatus,
            timeout=self.settings.request_timeout_s,
        )
        return as_json(status)

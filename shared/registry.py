"""The model registry and the cold-start log, in Valkey (persistence is the server's: AOF on).

Keys: `tessera:models` (hash name → ModelRecord), `tessera:adapters` (hash name →
AdapterRecord: LoRA adapters on a registered base), `tessera:adapters_of:<base>` (set of its
adapters' names: what a model's removal checks in the same step), `tessera:aliases` (hash name
→ ModelAlias), `tessera:coldstarts` (list, newest first).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

import redis.asyncio as aioredis
from redis.commands.core import AsyncScript

from shared.adapters import AdapterRecord
from shared.bus import decode, encode
from shared.messages import ColdStartRecorded, ModelRecord
from shared.routing_messages import ModelAlias

MODELS_KEY = "tessera:models"
ADAPTERS_KEY = "tessera:adapters"
ADAPTERS_OF_PREFIX = "tessera:adapters_of:"
ALIASES_KEY = "tessera:aliases"
COLD_STARTS_KEY = "tessera:coldstarts"
COLD_STARTS_KEPT = 200


def _raw(value: bytes | str) -> bytes:
    """redis-py types every reply `bytes | str`; a client without `decode_responses` (as
    `shared.runtime.connect_valkey` makes it) returns bytes, which msgpack needs."""
    if isinstance(value, str):
        raise TypeError("the Valkey client must not decode responses: msgpack values are bytes")
    return value


class AdapterPut(IntEnum):
    """What `Registry.put_adapter_new` did."""

    STORED = 1
    NO_BASE = -1
    MODEL_NAME = -2
    """A model has the name."""
    ADAPTER_NAME = -3
    """An adapter has the name."""


@dataclass(frozen=True)
class Removal:
    found: bool
    removed: bool
    adapters: list[str]
    """Its adapters: removed with it (cascade), or what kept it."""


def _adapters_of(base: str) -> str:
    return f"{ADAPTERS_OF_PREFIX}{base}"


# KEYS: models, adapters, the base's adapter set. ARGV: base, name, record.
_PUT_ADAPTER = """
if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 0 then return -1 end
if redis.call('HEXISTS', KEYS[1], ARGV[2]) == 1 then return -2 end
if redis.call('HSETNX', KEYS[2], ARGV[2], ARGV[3]) == 0 then return -3 end
redis.call('SADD', KEYS[3], ARGV[2])
return 1
"""
# KEYS: adapters. ARGV: name, record. Only over a stored one: a removed adapter stays removed.
_UPDATE_ADAPTER = """
if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 0 then return 0 end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
return 1
"""
# KEYS: models, adapters, the model's adapter set. ARGV: name, cascade ("1" or "0").
# Returns {-1} (no such model), {0, adapters...} (kept by them), {1, adapters removed...}.
_REMOVE_MODEL = """
if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 0 then return {-1} end
local names = redis.call('SMEMBERS', KEYS[3])
if #names > 0 and ARGV[2] ~= '1' then return {0, unpack(names)} end
for _, n in ipairs(names) do redis.call('HDEL', KEYS[2], n) end
redis.call('DEL', KEYS[3])
redis.call('HDEL', KEYS[1], ARGV[1])
return {1, unpack(names)}
"""


class Registry:
    def __init__(self, valkey: aioredis.Redis) -> None:
        self.valkey = valkey
        self._put_adapter: AsyncScript | None = None
        self._update_adapter: AsyncScript | None = None
        self._remove_model: AsyncScript | None = None

    async def put(self, record: ModelRecord) -> None:
        await self.valkey.hset(MODELS_KEY, record.name, encode(record))

    async def put_new(self, record: ModelRecord) -> bool:
        """Store `record` unless its name is taken (atomic: of two registering one name at
        once, one wins); whether it was stored."""
        return bool(await self.valkey.hsetnx(MODELS_KEY, record.name, encode(record)))

    async def get(self, name: str) -> ModelRecord | None:
        data = await self.valkey.hget(MODELS_KEY, name)
        return None if data is None else decode(_raw(data), ModelRecord)

    async def all(self) -> list[ModelRecord]:
        items = await self.valkey.hgetall(MODELS_KEY)
        return sorted((decode(_raw(v), ModelRecord) for v in items.values()), key=lambda r: r.name)

    async def put_adapter_new(self, record: AdapterRecord) -> AdapterPut:
        """Store `record` if its base is registered and its name is free among models and
        adapters, in one step: a base removed meanwhile never keeps an orphan adapter."""
        if self._put_adapter is None:
            self._put_adapter = self.valkey.register_script(_PUT_ADAPTER)
        keys = [MODELS_KEY, ADAPTERS_KEY, _adapters_of(record.base)]
        return AdapterPut(int(await self._put_adapter(keys=keys, args=[record.base, record.name, encode(record)])))

    async def update_adapter(self, record: AdapterRecord) -> bool:
        """Store `record` over the adapter of its name; False where none is stored (removed)."""
        if self._update_adapter is None:
            self._update_adapter = self.valkey.register_script(_UPDATE_ADAPTER)
        return bool(await self._update_adapter(keys=[ADAPTERS_KEY], args=[record.name, encode(record)]))

    async def get_adapter(self, name: str) -> AdapterRecord | None:
        data = await self.valkey.hget(ADAPTERS_KEY, name)
        return None if data is None else decode(_raw(data), AdapterRecord)

    async def adapters(self, base: str | None = None) -> list[AdapterRecord]:
        """Every adapter, or those of `base`, by name."""
        items = await self.valkey.hgetall(ADAPTERS_KEY)
        found = (decode(_raw(v), AdapterRecord) for v in items.values())
        return sorted((a for a in found if base is None or a.base == base), key=lambda a: a.name)

    async def remove_adapter(self, record: AdapterRecord) -> bool:
        async with self.valkey.pipeline(transaction=True) as pipe:
            pipe.hdel(ADAPTERS_KEY, record.name)
            pipe.srem(_adapters_of(record.base), record.name)
            removed, _ = await pipe.execute()
        return bool(removed)

    async def remove_model(self, name: str, cascade: bool = False) -> Removal:
        """Remove a model unless it has adapters; with `cascade`, with them. One step: an
        adapter registered meanwhile is either refused (its base is gone) or counted here."""
        if self._remove_model is None:
            self._remove_model = self.valkey.register_script(_REMOVE_MODEL)
        keys = [MODELS_KEY, ADAPTERS_KEY, _adapters_of(name)]
        status, *names = await self._remove_model(keys=keys, args=[name, "1" if cascade else "0"])
        adapters = sorted(n.decode() if isinstance(n, bytes) else str(n) for n in names)
        return Removal(found=int(status) >= 0, removed=int(status) == 1, adapters=adapters)

    async def put_alias(self, alias: ModelAlias) -> None:
        await self.valkey.hset(ALIASES_KEY, alias.name, encode(alias))

    async def alias(self, name: str) -> ModelAlias | None:
        data = await self.valkey.hget(ALIASES_KEY, name)
        return None if data is None else decode(_raw(data), ModelAlias)

    async def aliases(self) -> list[ModelAlias]:
        items = await self.valkey.hgetall(ALIASES_KEY)
        return sorted((decode(_raw(v), ModelAlias) for v in items.values()), key=lambda a: a.name)

    async def remove_alias(self, name: str) -> bool:
        return bool(await self.valkey.hdel(ALIASES_KEY, name))

    async def record_cold_start(self, event: ColdStartRecorded) -> None:
        async with self.valkey.pipeline(transaction=True) as pipe:
            pipe.lpush(COLD_STARTS_KEY, encode(event))
            pipe.ltrim(COLD_STARTS_KEY, 0, COLD_STARTS_KEPT - 1)
            await pipe.execute()

    async def cold_starts(self, limit: int = 50) -> list[ColdStartRecorded]:
        items = await self.valkey.lrange(COLD_STARTS_KEY, 0, limit - 1)
        return [decode(_raw(v), ColdStartRecorded) for v in items]

"""The model registry and the cold-start log, in Valkey (persistence is the server's: AOF on).

Keys: `tessera:models` (hash name → ModelRecord), `tessera:aliases` (hash name → ModelAlias),
`tessera:coldstarts` (list, newest first).
"""

from __future__ import annotations

import redis.asyncio as aioredis

from shared.bus import decode, encode
from shared.messages import ColdStartRecorded, ModelRecord
from shared.routing_messages import ModelAlias

MODELS_KEY = "tessera:models"
ALIASES_KEY = "tessera:aliases"
COLD_STARTS_KEY = "tessera:coldstarts"
COLD_STARTS_KEPT = 200


def _raw(value: bytes | str) -> bytes:
    """redis-py types every reply `bytes | str`; a client without `decode_responses` (as
    `shared.runtime.connect_valkey` makes it) returns bytes, which msgpack needs."""
    if isinstance(value, str):
        raise TypeError("the Valkey client must not decode responses: msgpack values are bytes")
    return value


class Registry:
    def __init__(self, valkey: aioredis.Redis) -> None:
        self.valkey = valkey

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

    async def remove(self, name: str) -> bool:
        return bool(await self.valkey.hdel(MODELS_KEY, name))

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

"""API keys and their quotas, in Valkey so that every gateway replica sees the same keys and
counts against the same limits.

Only the sha256 of a key is stored: the secret is shown once, when the key is made. Keys are
256 random bits, so a fast hash is as safe as a slow one here (there is nothing to guess).

Valkey keys: `tessera:apikeys` (hash sha256 → ApiKeyRecord as JSON), `tessera:apikey_names`
(hash name → sha256), `tessera:ratelimit:<name>:<rpm|tpm>:<window>` (counters that expire).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import msgspec
import redis.asyncio as aioredis
from fastapi import Request
from redis.commands.core import AsyncScript

from services.gateway.ratelimit import Counts, Decision, decide, retry_after_header
from services.gateway.settings import GatewaySettings
from shared.registry import Registry

log = logging.getLogger(__name__)

KEYS_KEY = "tessera:apikeys"
NAMES_KEY = "tessera:apikey_names"
RATE_PREFIX = "tessera:ratelimit:"
WINDOW_S = 60.0
"""Both limits are per minute, as OpenAI's are."""
SECRET_PREFIX = "tsk-"


class ApiError(Exception):
    """An HTTP error with OpenAI's body, for what `shared.errors.ErrorCode` does not cover
    (it names failures that travel on the bus; these never leave the gateway)."""

    def __init__(
        self,
        status: int,
        message: str,
        code: str,
        *,
        param: str | None = None,
        retry_after_s: float | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.retry_after_s = retry_after_s
        self.headers = headers or {}


class ApiKeyRecord(msgspec.Struct, frozen=True):
    """A key as stored: everything but the secret."""

    name: str
    digest: str
    """sha256 of the secret, hex."""
    hint: str
    """The first characters of the secret, so that an operator can tell keys apart."""
    models: tuple[str, ...] = ()
    """Models the key may use; empty: every model."""
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    """Prompt + completion tokens; a request reserves prompt + max_tokens and is settled with
    the tokens it really produced."""
    created_at: float = 0.0

    def public(self) -> dict[str, object]:
        return {
            "name": self.name,
            "hint": self.hint,
            "models": list(self.models),
            "requests_per_minute": self.requests_per_minute,
            "tokens_per_minute": self.tokens_per_minute,
            "created_at": self.created_at,
        }


def digest(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


@dataclass(frozen=True)
class Principal:
    """Who is calling: a key, the admin, or anyone when auth is off."""

    name: str
    admin: bool = False
    models: tuple[str, ...] = ()
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None

    def may_use(self, model: str) -> bool:
        return not self.models or model in self.models

    @property
    def limited(self) -> bool:
        return self.requests_per_minute is not None or self.tokens_per_minute is not None


OPEN = Principal(name="open", admin=True)
ADMIN = Principal(name="admin", admin=True)


class KeyStore:
    def __init__(self, registry: Registry) -> None:
        # The registry's connection, read per call: the gateway has one Valkey client.
        self._registry = registry

    @property
    def valkey(self) -> aioredis.Redis:
        return self._registry.valkey

    async def create(
        self, name: str, models: Sequence[str], requests_per_minute: int | None, tokens_per_minute: int | None
    ) -> tuple[str, ApiKeyRecord]:
        secret = SECRET_PREFIX + secrets.token_urlsafe(32)
        record = ApiKeyRecord(
            name=name,
            digest=digest(secret),
            hint=secret[:10] + "…",
            models=tuple(models),
            requests_per_minute=requests_per_minute,
            tokens_per_minute=tokens_per_minute,
            created_at=time.time(),
        )
        # HSETNX claims the name atomically: two admins creating one name cannot both win.
        if not await self.valkey.hsetnx(NAMES_KEY, name, record.digest):
            raise ApiError(409, f"an API key named `{name}` exists already", "key_exists", param="name")
        await self.valkey.hset(KEYS_KEY, record.digest, msgspec.json.encode(record))
        return secret, record

    async def get(self, secret: str) -> ApiKeyRecord | None:
        data = await self.valkey.hget(KEYS_KEY, digest(secret))
        return None if data is None else msgspec.json.decode(data, type=ApiKeyRecord)

    async def all(self) -> list[ApiKeyRecord]:
        items = await self.valkey.hgetall(KEYS_KEY)
        return sorted((msgspec.json.decode(v, type=ApiKeyRecord) for v in items.values()), key=lambda r: r.name)

    async def delete(self, name: str) -> bool:
        found = await self.valkey.hget(NAMES_KEY, name)
        if found is None:
            return False
        async with self.valkey.pipeline(transaction=True) as pipe:
            pipe.hdel(KEYS_KEY, found)
            pipe.hdel(NAMES_KEY, name)
            await pipe.execute()
        return True


# Counts first, in one atomic step with Valkey's own clock (replicas' clocks may differ):
# increments each limit's current window by its cost and reads the previous window.
# ARGV: window_ms, then (key prefix, cost) pairs. Returns now_ms, window index, then
# (current, previous) per pair.
_COUNT = """
local window_ms = tonumber(ARGV[1])
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local w = math.floor(now_ms / window_ms)
local out = {now_ms, w}
for i = 2, #ARGV, 2 do
  local cur = ARGV[i] .. w
  local n = redis.call('INCRBY', cur, ARGV[i + 1])
  redis.call('PEXPIRE', cur, 2 * window_ms + 1000)
  local prev = tonumber(redis.call('GET', ARGV[i] .. (w - 1)) or '0')
  table.insert(out, n)
  table.insert(out, prev)
end
return out
"""


@dataclass
class Grant:
    """An admitted request's place in the token counter, to settle once its length is known."""

    key: str = ""
    reserved_completion: int = 0
    settled: bool = field(default=False)


class Quotas:
    """Moves the numbers between Valkey and `ratelimit.decide`."""

    def __init__(self, keys: KeyStore) -> None:
        self.keys = keys
        self._script: AsyncScript | None = None

    async def admit(self, who: Principal, prompt_tokens: int, max_tokens: int) -> Grant:
        if not who.limited:
            return Grant()
        limits = [
            ("requests", "rpm", who.requests_per_minute, 1),
            ("tokens", "tpm", who.tokens_per_minute, prompt_tokens + max_tokens),
        ]
        limits = [lim for lim in limits if lim[2] is not None]
        argv: list[str | int] = [int(WINDOW_S * 1000)]
        for _, tag, _, cost in limits:
            argv += [f"{RATE_PREFIX}{who.name}:{tag}:", cost]
        valkey = self.keys.valkey
        if self._script is None:
            self._script = valkey.register_script(_COUNT)
        out = [int(v) for v in await self._script(args=argv)]
        now, window = out[0] / 1000.0, out[1]
        denied: list[tuple[str, int, int, Decision]] = []
        for i, (what, _, limit, cost) in enumerate(limits):
            assert limit is not None
            counts = Counts(limit=limit, current=out[2 + 2 * i], previous=out[3 + 2 * i], cost=cost)
            decision = decide(counts, now, WINDOW_S)
            if not decision.allowed:
                denied.append((what, limit, cost, decision))
        if denied:
            # Not admitted: its cost must not keep others out.
            async with valkey.pipeline(transaction=True) as pipe:
                for _, tag, _, cost in limits:
                    pipe.decrby(f"{RATE_PREFIX}{who.name}:{tag}:{window}", cost)
                await pipe.execute()
            raise _rate_limited(who, denied)
        if who.tokens_per_minute is None:
            return Grant()
        return Grant(key=f"{RATE_PREFIX}{who.name}:tpm:{window}", reserved_completion=max_tokens)

    async def settle(self, grant: Grant, completion_tokens: int) -> None:
        """Give back the part of the reservation the completion did not use."""
        if not grant.key or grant.settled:
            return
        grant.settled = True
        unused = grant.reserved_completion - completion_tokens
        if unused <= 0:
            return
        try:
            async with self.keys.valkey.pipeline(transaction=True) as pipe:
                pipe.decrby(grant.key, unused)
                # A counter that expired meanwhile comes back negative: let it expire again.
                pipe.pexpire(grant.key, int(2 * WINDOW_S * 1000) + 1000)
                await pipe.execute()
        except Exception:
            # The request is served; a lost refund only makes the limit stricter for a minute.
            log.warning("could not settle the token count of key %s", grant.key, exc_info=True)


def _rate_limited(who: Principal, denied: list[tuple[str, int, int, Decision]]) -> ApiError:
    parts = []
    retries = []
    for what, limit, cost, d in denied:
        if d.retry_after_s is None:
            return ApiError(
                429,
                f"Request too large for key `{who.name}`: it needs {cost} {what} "
                f"(prompt + max_tokens) and the limit is {limit} {what} per minute. Lower "
                "max_tokens or shorten the prompt.",
                "rate_limit_exceeded",
            )
        parts.append(f"{what} per minute (limit {limit})")
        retries.append(d.retry_after_s)
    wait = max(retries)
    return ApiError(
        429,
        f"Rate limit reached for key `{who.name}` on {' and '.join(parts)}. "
        f"Please try again in {retry_after_header(wait)}s.",
        "rate_limit_exceeded",
        retry_after_s=wait,
    )


class Auth:
    """Who a request comes from (`Authorization: Bearer <key>`, what OpenAI clients send)."""

    def __init__(self, settings: GatewaySettings, keys: KeyStore) -> None:
        self.enabled = settings.auth
        self.keys = keys
        admin_key = settings.admin_key
        if self.enabled and not admin_key:
            admin_key = "tsk-admin-" + secrets.token_urlsafe(32)
            # The only place it can be read; replicas need TESSERA_ADMIN_KEY to share one.
            log.warning("TESSERA_ADMIN_KEY is not set; this gateway's admin key is %s", admin_key)
        self._admin_digest = digest(admin_key) if admin_key else ""

    async def principal(self, request: Request) -> Principal:
        if not self.enabled:
            return OPEN
        header = request.headers.get("authorization", "")
        scheme, _, secret = header.partition(" ")
        secret = secret.strip()
        if scheme.lower() != "bearer" or not secret:
            raise _unauthorized(
                "You didn't provide an API key. You need to provide your API key in an "
                "Authorization header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY)."
            )
        if self._admin_digest and hmac.compare_digest(digest(secret), self._admin_digest):
            return ADMIN
        record = await self.keys.get(secret)
        if record is None:
            shown = secret[:6] + "*" * 4 + secret[-4:] if len(secret) > 12 else "*" * len(secret)
            raise _unauthorized(f"Incorrect API key provided: {shown}.")
        return Principal(
            name=record.name,
            models=record.models,
            requests_per_minute=record.requests_per_minute,
            tokens_per_minute=record.tokens_per_minute,
        )

    async def admin(self, request: Request) -> Principal:
        who = await self.principal(request)
        if not who.admin:
            raise ApiError(403, "The admin API needs the admin key (TESSERA_ADMIN_KEY).", "admin_key_required")
        return who


def check_model(who: Principal, model: str) -> None:
    if not who.may_use(model):
        raise ApiError(
            403, f"The API key `{who.name}` may not use the model `{model}`.", "model_not_allowed", param="model"
        )


def _unauthorized(message: str) -> ApiError:
    return ApiError(401, message, "invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

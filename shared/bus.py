"""The bus: one NATS connection per service, msgpack codec, typed request/reply.

nats-py reconnects by itself (forever, here); `Bus.connected` follows its callbacks so that
`/readyz` tells the truth while it does.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import msgspec
import nats
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout

from shared.errors import TesseraError
from shared.messages import ErrorCode, Message

log = logging.getLogger(__name__)

T = TypeVar("T")

_encoder = msgspec.msgpack.Encoder()


def encode(message: Message) -> bytes:
    return _encoder.encode(message)


def decode(data: bytes, type_: type[T]) -> T:
    """Decode into the declared type (a struct or a union of structs); raises on a mismatch."""
    return msgspec.msgpack.decode(data, type=type_)


Handler = Callable[[Msg], Awaitable[None]]


class Bus:
    def __init__(self, name: str) -> None:
        self.name = name
        self.nc: Client | None = None
        self.connected = asyncio.Event()
        self._tasks: set[asyncio.Task[Any]] = set()

    async def connect(self, url: str) -> None:
        async def on_disconnect() -> None:
            self.connected.clear()
            log.warning("nats disconnected", extra={"service": self.name})

        async def on_reconnect() -> None:
            self.connected.set()
            log.info("nats reconnected", extra={"service": self.name})

        async def on_error(e: Exception) -> None:
            log.warning("nats error: %s", e, extra={"service": self.name})

        self.nc = await nats.connect(
            url,
            name=self.name,
            max_reconnect_attempts=-1,
            reconnect_time_wait=0.5,
            allow_reconnect=True,
            connect_timeout=5,
            disconnected_cb=on_disconnect,
            reconnected_cb=on_reconnect,
            error_cb=on_error,
        )
        if self.nc.is_connected:
            self.connected.set()

    @property
    def client(self) -> Client:
        assert self.nc is not None, "Bus.connect() first"
        return self.nc

    async def close(self) -> None:
        if self.nc is not None and not self.nc.is_closed:
            await self.nc.drain()

    async def publish(self, subject: str, message: Message) -> None:
        await self.client.publish(subject, encode(message))

    async def reply(self, msg: Msg, message: Message) -> None:
        if msg.reply:
            await self.client.publish(msg.reply, encode(message))

    async def request(self, subject: str, message: Message, reply_type: type[T], timeout: float) -> T:
        """Request/reply with a timeout; bus failures become `TesseraError`s a client can read."""
        try:
            msg = await self.client.request(subject, encode(message), timeout=timeout)
        except NoRespondersError as e:
            raise TesseraError(ErrorCode.UNAVAILABLE, f"no service is listening on {subject}", retry_after_s=1) from e
        except NatsTimeout as e:
            raise TesseraError(
                ErrorCode.UNAVAILABLE, f"no reply on {subject} within {timeout:g}s", retry_after_s=1
            ) from e
        return decode(msg.data, reply_type)

    async def subscribe(self, subject: str, handler: Handler | None = None, queue: str = "") -> Subscription:
        """Subscribe; with a handler, each message runs in a task of its own so that a long
        handler (a cold start) never holds up the next message."""
        if handler is None:
            return await self.client.subscribe(subject, queue=queue)

        async def spawn(msg: Msg) -> None:
            task = asyncio.create_task(handler(msg))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            task.add_done_callback(_log_task_error)

        return await self.client.subscribe(subject, queue=queue, cb=spawn)


def _log_task_error(task: asyncio.Task[Any]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("handler task failed", exc_info=task.exception())

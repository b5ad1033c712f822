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
from typing_extensions import TypeForm

from shared.errors import TesseraError
from shared.messages import ErrorCode, Message, Rejected

log = logging.getLogger(__name__)

T = TypeVar("T")

_encoder = msgspec.msgpack.Encoder()


def encode(message: Message) -> bytes:
    return _encoder.encode(message)


def decode(data: bytes, type_: TypeForm[T]) -> T:
    """Decode into the declared type (a struct or a union of structs); raises on a mismatch.
    `TypeForm` (PEP 747): `A | B` is a `types.UnionType` at runtime, not a `type[T]`."""
    return msgspec.msgpack.decode(data, type=type_)


Handler = Callable[[Msg], Awaitable[None]]


def error_reply(exc: Exception, subject: str, service: str) -> Rejected:
    """The typed answer to a request whose handler raised `exc` before it replied.

    A `TesseraError` keeps its code; anything else is a fault of the service, which the caller
    may retry (UNAVAILABLE: `ErrorCode` has no "internal", and a peer that does not know a new
    code could not decode the answer at all). The message names the exception so that the
    caller's error says what went wrong without a look at this service's logs."""
    if isinstance(exc, TesseraError):
        return Rejected(code=exc.code, message=exc.message, retry_after_s=exc.retry_after_s)
    return Rejected(
        code=ErrorCode.UNAVAILABLE,
        message=f"{service} failed to answer {subject}: {type(exc).__name__}: {exc}",
        retry_after_s=1,
    )


def as_rejected(data: bytes) -> Rejected | None:
    """`data` decoded as a `Rejected`, or None if it is not one."""
    try:
        return decode(data, Rejected)
    except msgspec.DecodeError:  # ValidationError is one: another message, or no message at all
        return None


class Bus:
    def __init__(self, name: str) -> None:
        self.name = name
        self.nc: Client | None = None
        self.connected = asyncio.Event()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._unanswered: set[str] = set()
        """Reply subjects of requests whose handler runs and has not replied yet: a handler
        that raises is answered by the bus (`_run`) only if it had not answered itself."""

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
        """Drain (what is in flight goes out), or just close where the server is already gone
        (a cluster that stops NATS first): a service's shutdown never ends in a traceback."""
        if self.nc is None or self.nc.is_closed:
            return
        try:
            await self.nc.drain()
        except (nats.errors.ConnectionReconnectingError, nats.errors.ConnectionClosedError) as e:
            log.info("bus closed without draining: %s", type(e).__name__, extra={"service": self.name})
            await self.nc.close()

    async def publish(self, subject: str, message: Message) -> None:
        await self.client.publish(subject, encode(message))

    async def reply(self, msg: Msg, message: Message) -> None:
        if msg.reply:
            await self.client.publish(msg.reply, encode(message))
            self._unanswered.discard(msg.reply)

    async def request(self, subject: str, message: Message, reply_type: TypeForm[T], timeout: float) -> T:
        """Request/reply with a timeout; bus failures become `TesseraError`s a client can read."""
        try:
            msg = await self.client.request(subject, encode(message), timeout=timeout)
        except NoRespondersError as e:
            raise TesseraError(ErrorCode.UNAVAILABLE, f"no service is listening on {subject}", retry_after_s=1) from e
        except NatsTimeout as e:
            raise TesseraError(
                ErrorCode.UNAVAILABLE, f"no reply on {subject} within {timeout:g}s", retry_after_s=1
            ) from e
        try:
            return decode(msg.data, reply_type)
        except msgspec.ValidationError:
            # A handler that failed is answered with `Rejected` (`_run`), whatever the caller
            # expects: a caller that does not take a `Rejected` gets it as the error it is.
            rejected = as_rejected(msg.data)
            if rejected is None:
                raise
            raise TesseraError(rejected.code, rejected.message, retry_after_s=rejected.retry_after_s) from None

    async def subscribe(self, subject: str, handler: Handler | None = None, queue: str = "") -> Subscription:
        """Subscribe; with a handler, each message runs in a task of its own so that a long
        handler (a cold start) never holds up the next message."""
        if handler is None:
            return await self.client.subscribe(subject, queue=queue)

        async def spawn(msg: Msg) -> None:
            task = asyncio.create_task(self._run(handler, msg))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            task.add_done_callback(_log_task_error)

        return await self.client.subscribe(subject, queue=queue, cb=spawn)

    async def _run(self, handler: Handler, msg: Msg) -> None:
        """Run one message's handler; if it raises, log it once (here, with its traceback) and,
        for a request it has not answered, answer with the error: the caller gets it at once
        instead of waiting for its own timeout (up to a cold start's 300 s)."""
        if msg.reply:
            self._unanswered.add(msg.reply)
        try:
            await handler(msg)
        except Exception as e:
            answer = bool(msg.reply) and msg.reply in self._unanswered
            level = logging.WARNING if isinstance(e, TesseraError) else logging.ERROR
            log.log(
                level,
                "handler of %s failed%s: %s",
                msg.subject,
                ", answered with the error" if answer else "",
                e,
                exc_info=e,
                extra={"service": self.name},
            )
            if answer:
                try:
                    await self.reply(msg, error_reply(e, msg.subject, self.name))
                except Exception as reply_error:  # the bus itself is gone: the caller times out
                    log.warning("could not send the error reply on %s: %s", msg.subject, reply_error)
        finally:
            if msg.reply:
                self._unanswered.discard(msg.reply)


def _log_task_error(task: asyncio.Task[Any]) -> None:
    # `Bus._run` logs what a handler raises; only what escapes it (not an `Exception`) is left.
    if not task.cancelled() and task.exception() is not None:
        log.error("handler task failed", exc_info=task.exception())

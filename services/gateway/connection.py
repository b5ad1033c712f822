"""The gateway's HTTP/1.1 connections: uvicorn's h11 protocol with two guards uvicorn lacks.

- **A request head has a deadline** (`request_head_timeout_s`). uvicorn bounds only the idle
  time between requests (`timeout_keep_alive`, cancelled by the first byte of the next one), so
  a client that sends a head a byte at a time, or connects and sends nothing, held a connection
  (and a file descriptor) for ever: slowloris. The deadline runs from the connection's opening,
  or from the first byte of a later request, to its head being whole; past it the client gets
  408 and the connection is closed (Apache's `mod_reqtimeout`, nginx's `client_header_timeout`).
- **One framing per request.** A request with both `Content-Length` and `Transfer-Encoding`
  is framed by h11 by the chunked coding, and what its length would have covered is read as the
  next request: request smuggling, where a proxy in front frames it by the length. RFC 9112
  §6.3 lets a server refuse it and requires the connection be closed: it is a 400 and closed.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import h11
from prometheus_client import Counter
from uvicorn.config import Config
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.server import ServerState

from services.gateway.openai_format import error_body

MAX_HEAD_BYTES = 16 * 1024
"""Largest request head (h11's default, stated here: the guard below builds the connection)."""

HEADS_TIMED_OUT = Counter(
    "tessera_gateway_request_heads_timed_out_total",
    "Connections closed because a request head was not complete within request_head_timeout_s",
)


class OneFraming(h11.Connection):
    """An h11 server connection that refuses a request framed two ways (RFC 9112 §6.3), and
    keeps what was wrong with a request it refused (`refusal`)."""

    refusal = "the request is not valid HTTP/1.1"

    def next_event(self) -> Any:
        try:
            event = super().next_event()
        except h11.RemoteProtocolError as e:
            self.refusal = f"the request is not valid HTTP/1.1: {str(e)[:200]}"
            raise
        if isinstance(event, h11.Request):
            names = {name.lower() for name, _ in event.headers}
            if b"content-length" in names and b"transfer-encoding" in names:
                # uvicorn answers a RemoteProtocolError with 400 and closes the connection.
                self.refusal = "a request must not have both Content-Length and Transfer-Encoding"
                raise h11.RemoteProtocolError(self.refusal, error_status_hint=400)
        return event


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline on each request head and one framing per request."""

    head_timeout_s: float = 20.0
    """Set per server by `guarded_protocol`: uvicorn builds the protocol from the class."""

    def __init__(
        self,
        config: Config,
        server_state: ServerState,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self.conn = OneFraming(h11.SERVER, config.h11_max_incomplete_event_size or MAX_HEAD_BYTES)
        self.head_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)  # type: ignore[arg-type]
        self.await_head()

    def data_received(self, data: bytes) -> None:
        if self.conn.their_state is h11.IDLE:  # the first bytes of a request (else a no-op)
            self.await_head()
        super().data_received(data)

    def handle_events(self) -> None:
        super().handle_events()
        if self.conn.their_state is not h11.IDLE:  # the head is whole (or the request failed)
            self.head_arrived()
        elif self.conn.trailing_data[0]:  # part of a pipelined head, read before its turn
            self.await_head()

    def connection_lost(self, exc: Exception | None) -> None:
        self.head_arrived()
        super().connection_lost(exc)

    def await_head(self) -> None:
        if self.head_deadline is None:
            self.head_deadline = self.loop.call_later(self.head_timeout_s, self.head_too_slow)

    def head_arrived(self) -> None:
        if self.head_deadline is not None:
            self.head_deadline.cancel()
            self.head_deadline = None

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to a request h11 refused, with OpenAI's error body (not plain text)."""
        refusal = self.conn.refusal if isinstance(self.conn, OneFraming) else msg
        body = json.dumps(error_body(400, refusal, "invalid_http_request")).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
        ]
        try:
            self.transport.write(self.conn.send(h11.Response(status_code=400, headers=headers)) or b"")
            self.transport.write(self.conn.send(h11.Data(data=body)) or b"")
            self.transport.write(self.conn.send(h11.EndOfMessage()) or b"")
        except h11.LocalProtocolError:  # a response already under way: just close
            pass
        self.transport.close()

    def head_too_slow(self) -> None:
        self.head_deadline = None
        if self.conn.their_state is not h11.IDLE or self.transport.is_closing():
            return
        HEADS_TIMED_OUT.inc()
        try:
            headers = [(b"connection", b"close"), (b"content-length", b"0")]
            self.transport.write(self.conn.send(h11.Response(status_code=408, headers=headers)) or b"")
            self.transport.write(self.conn.send(h11.EndOfMessage()) or b"")
        except h11.LocalProtocolError:  # a response already under way: just close
            pass
        self.transport.close()


def guarded_protocol(head_timeout_s: float) -> type[GuardedH11Protocol]:
    """The protocol class for `uvicorn.Config(http=...)`, with this head deadline."""
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {"head_timeout_s": head_timeout_s})

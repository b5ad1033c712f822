"""The gateway's HTTP connections (`services.gateway.connection`) on a real uvicorn server and
raw sockets: a request head that never completes is cut off, and a request framed two ways is
refused and its connection closed. The gateway app runs without bus or Valkey (/healthz needs
neither)."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator

import pytest

from services.gateway.admin import Admin
from services.gateway.connection import guarded_protocol
from services.gateway.routes import create_app
from services.gateway.serving import Gateway
from services.gateway.settings import GatewaySettings
from shared.health import Readiness, http_server

HEAD_TIMEOUT_S = 0.5
WAIT_S = 30.0
"""Longest a read waits for the server: a bound on a hang, far past the head deadline."""

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
async def port() -> AsyncIterator[int]:
    settings = GatewaySettings(request_head_timeout_s=HEAD_TIMEOUT_S)
    app = create_app(Gateway(settings, None, None), Admin(settings, None, None), Readiness("gateway"))  # type: ignore[arg-type]
    listener = socket.create_server(("127.0.0.1", 0))  # bound before serving: connections queue
    server = http_server(app, "127.0.0.1", 0, http=guarded_protocol(settings.request_head_timeout_s))
    task = asyncio.create_task(server.serve(sockets=[listener]))
    try:
        yield listener.getsockname()[1]
    finally:
        server.should_exit = True
        await task
        listener.close()


def _until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (socket.timeout: it never did)."""
    received = b""
    while data := sock.recv(65536):
        received += data
    return received


def _exchange(port: int, *sends: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=WAIT_S) as sock:
        for data in sends:
            sock.sendall(data)
        return _until_closed(sock)


HEALTHZ = b"GET /healthz HTTP/1.1\r\nHost: gw\r\n\r\n"


async def test_a_request_head_never_finished_is_answered_408_and_the_connection_closed(port: int) -> None:
    received = await asyncio.to_thread(_exchange, port, b"GET /healthz HTTP/1.1\r\nHost: gw\r\nX-Slow: 1")
    assert received.startswith(b"HTTP/1.1 408 ")


async def test_a_connection_that_sends_nothing_is_closed(port: int) -> None:
    received = await asyncio.to_thread(_exchange, port)
    assert received.startswith(b"HTTP/1.1 408 ")


async def test_a_second_head_left_unfinished_on_a_kept_alive_connection_is_cut_off(port: int) -> None:
    received = await asyncio.to_thread(_exchange, port, HEALTHZ + b"GET /healthz HTTP/1.1\r\nHo")
    first, _, rest = received.partition(b"\r\n\r\n")
    assert first.startswith(b"HTTP/1.1 200 ")
    assert b"HTTP/1.1 408 " in rest


async def test_a_request_with_both_content_length_and_chunked_is_400_and_nothing_after_it_is_served(
    port: int,
) -> None:
    smuggled = (
        b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
        b"Content-Length: 40\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"0\r\n\r\n" + HEALTHZ
    )
    received = await asyncio.to_thread(_exchange, port, smuggled)
    assert received.startswith(b"HTTP/1.1 400 ")
    assert received.count(b"HTTP/1.1 ") == 1  # the request hidden in the body was not read
    error = json.loads(received.partition(b"\r\n\r\n")[2])["error"]
    assert error["type"] == "invalid_request_error" and "Transfer-Encoding" in error["message"]


async def test_a_malformed_request_head_is_an_openai_400(port: int) -> None:
    received = await asyncio.to_thread(_exchange, port, b"GET /healthz HTTP/1.1\r\nno colon here\r\n\r\n")
    assert received.startswith(b"HTTP/1.1 400 ")
    assert json.loads(received.partition(b"\r\n\r\n")[2])["error"]["code"] == "invalid_http_request"


async def test_a_whole_request_is_served_on_a_connection_kept_alive(port: int) -> None:
    def two_requests() -> list[bytes]:
        with socket.create_connection(("127.0.0.1", port), timeout=WAIT_S) as sock:
            answers = []
            for _ in range(2):
                sock.sendall(HEALTHZ)
                answer = b""
                while b'"ok"' not in answer:
                    data = sock.recv(65536)
                    assert data, "closed mid-answer"
                    answer += data
                answers.append(answer)
            return answers

    for answer in await asyncio.to_thread(two_requests):
        assert answer.startswith(b"HTTP/1.1 200 ")

"""The services' Valkey client under a burst: every call answered, over a bounded pool."""

from __future__ import annotations

import asyncio
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from ops.localcluster import free_port, valkey_server_binary
from shared.runtime import VALKEY_CONNECTIONS, connect_valkey
from tests.helpers.cluster import wait_for


@pytest.fixture
def valkey_url(tmp_path: Path) -> Iterator[str]:
    port = free_port()
    cmd = [valkey_server_binary(), "--port", str(port), "--bind", "127.0.0.1", "--dir", str(tmp_path), "--save", ""]
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
    try:
        wait_for(lambda: _answers(port), 30, "valkey-server to answer")
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        server.terminate()
        server.wait(timeout=10)


def _answers(port: int) -> bool:
    try:
        with redis.Redis(port=port, socket_connect_timeout=1) as probe:
            return bool(probe.ping())
    except redis.ConnectionError:
        return False


async def test_a_burst_far_over_the_pool_waits_for_connections_and_every_call_is_answered(valkey_url: str) -> None:
    client = connect_valkey(valkey_url)
    try:
        await client.hset("models", "m", b"record")
        burst = 25 * VALKEY_CONNECTIONS
        answers = await asyncio.gather(*(client.hget("models", "m") for _ in range(burst)))
        assert answers == [b"record"] * burst  # none refused with "Too many connections"
        clients = await client.client_list()
        assert len(clients) <= VALKEY_CONNECTIONS  # the burst opened no more than the pool holds
    finally:
        await client.aclose()

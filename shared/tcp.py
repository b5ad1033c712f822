"""A TCP listener of a node's own (the loader's peer block server, a pipeline stage's server):
asyncio's server on a port, and the address it is reached at."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def listen(handler: Handler, host: str = "127.0.0.1", port: int = 0) -> tuple[asyncio.Server, str]:
    """A server running `handler` per connection on host:port (0: a free port the kernel picks),
    and the `host:port` it listens on."""
    server = await asyncio.start_server(handler, host, port)
    sock = server.sockets[0].getsockname()
    return server, f"{sock[0]}:{sock[1]}"

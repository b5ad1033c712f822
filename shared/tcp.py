"""A TCP listener of a node's own (the loader's peer block server, a pipeline stage's server):
asyncio's server on a port, the address it is reached at, and a close that ends the
connections in progress too."""

from __future__ import annotations

import asyncio


class Listener:
    """Serves `_serve` per connection once started; `close` stops listening, ends the
    connections in progress (`_end_connections`: a closed server is a dead peer to its
    readers) and waits for the server to be gone."""

    _server: asyncio.Server | None = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        raise NotImplementedError

    async def _end_connections(self) -> None:
        """End the connections in progress (each subclass knows what it holds of them)."""

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Listen on host:port (0: a free port the kernel picks): the `host:port` it listens on."""
        self._server = await asyncio.start_server(self._serve, host, port)
        sock = self._server.sockets[0].getsockname()
        return f"{sock[0]}:{sock[1]}"

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._end_connections()
            await self._server.wait_closed()

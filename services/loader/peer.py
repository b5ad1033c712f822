"""Blocks between nodes over TCP: the data path of a multicast (FaaScale §4).

Every loader runs a `BlockServer`: it serves the blocks of the sets it holds, including one
it is receiving, so a node forwards a block as soon as it has it (the binomial pipeline). A
target `receive`s its plan's feeds in order, one block at a time, checking each block's
SHA-256 before writing it; a source that fails (refused, reset, timed out, or a block that
does not match) is dropped and the block, and every later one it was to send, comes from the
fallbacks (the store, or another node that holds the set), so a peer that dies mid-transfer
costs time, never the scale-out.

Wire, per connection, request and answer in turn: a 4-byte big-endian length and a msgpack
`BlockRequest`; back a 4-byte length, a msgpack `BlockHeader`, and `length` bytes of block.

A `Link` shapes a node's uplink to a bandwidth (the loopback has none to speak of), so a
cluster on one machine is network-bound as a real one is; namespaces with `tc` shape it for
real where they are permitted.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import msgspec

from services.loader.blockset import BlockSet, block_ok, prepare, read_block, write_block
from shared.tcp import Listener

log = logging.getLogger(__name__)

_LEN = struct.Struct(">I")
SEND_BUFFER_BYTES = 256 * 1024
OFFER_WAIT_S = 5.0
"""How long a request for a set not (yet) offered here waits for it."""
WAIT_FOR_BLOCK_S = 15.0
"""How long a server waits for a block it is itself receiving before it answers "not here"
(its own source may be dead and it is falling back: the asker then falls back too). Below
the askers' own per-block timeout (`Multicast.timeout_s`, 30 s), so the answer comes first."""
SEND_TIMEOUT_S = 30.0
"""Longest one block may take to leave: a receiver that stops reading must not hold the
server's one send slot (everyone else's blocks) until TCP gives up on it."""


class BlockRequest(msgspec.Struct, frozen=True):
    set_id: str
    index: int


class BlockHeader(msgspec.Struct, frozen=True):
    ok: bool
    length: int = 0
    error: str = ""


class TransferFailed(Exception):
    """No source could supply a block."""


class Link:
    """A node's uplink shaped to `bps` bytes per second (0: as fast as it goes). Transfers
    share it first come, first served: each holds it for its bytes ÷ bps."""

    def __init__(self, bps: float = 0.0) -> None:
        self.bps = bps
        self._free_at = 0.0

    async def carry(self, nbytes: int) -> None:
        if self.bps <= 0:
            return
        now = time.monotonic()
        start = max(now, self._free_at)
        self._free_at = start + nbytes / self.bps
        await asyncio.sleep(self._free_at - now)


@dataclass
class Holding:
    """A block set on this node: its root, and which blocks are there (all, for a complete
    copy; a growing set while it is received)."""

    root: Path
    blocks: BlockSet
    have: set[int] = field(default_factory=set)
    _arrived: asyncio.Condition = field(default_factory=asyncio.Condition)

    @classmethod
    def complete(cls, root: Path, blocks: BlockSet) -> Holding:
        return cls(root, blocks, set(range(blocks.blocks)))

    async def mark(self, index: int) -> None:
        async with self._arrived:
            self.have.add(index)
            self._arrived.notify_all()

    async def wait_for(self, index: int, timeout_s: float) -> bool:
        async with self._arrived:
            try:
                await asyncio.wait_for(self._arrived.wait_for(lambda: index in self.have), timeout_s)
            except TimeoutError:
                return False
        return True


class BlockServer(Listener):
    """Serves the blocks of the sets offered to it, over TCP, through a shaped uplink."""

    def __init__(
        self,
        link: Link | None = None,
        wait_s: float = WAIT_FOR_BLOCK_S,
        on_served: Callable[[int], None] | None = None,
    ) -> None:
        self.link = link or Link()
        self.on_served = on_served
        """Told each block's bytes as it is sent (the loader counts them)."""
        self.wait_s = wait_s
        self.sets: dict[str, Holding] = {}
        self._offered = asyncio.Event()
        """Set (and replaced) whenever a set is offered: wakes the requests waiting for one."""
        self.awaiting_offer = 0
        """Requests waiting for a set to be offered."""
        self._writers: set[asyncio.StreamWriter] = set()
        self._sending = asyncio.Lock()
        """One block on the wire at a time, in the order asked for: two sent at once share
        the link and both arrive late, and so does everything forwarded behind them (the
        plan has a node send one block per step; measured through tc-shaped links, 8
        targets took 1.75x as long as 1 with concurrent sends)."""
        self.served_blocks = 0

    def offer(self, holding: Holding) -> None:
        self.sets[holding.blocks.set_id] = holding
        self._offered.set()
        self._offered = asyncio.Event()

    def withdraw(self, set_id: str) -> None:
        self.sets.pop(set_id, None)

    def withdraw_artifact(self, artifact_id: str) -> None:
        """Stop serving every set of an artifact (its copy is leaving the host cache)."""
        for set_id in [k for k in self.sets if k.split("/", 1)[0] == artifact_id]:
            del self.sets[set_id]

    async def _end_connections(self) -> None:
        for w in list(self._writers):
            w.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        # Small buffers, so that a send is done (and the next may start) when its bytes are
        # on the wire, not when they sit in a multi-megabyte socket buffer.
        sock = writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
        writer.transport.set_write_buffer_limits(high=SEND_BUFFER_BYTES)
        try:
            while True:
                try:
                    (n,) = _LEN.unpack(await reader.readexactly(_LEN.size))
                except asyncio.IncompleteReadError:
                    return  # the asker is done
                req = msgspec.msgpack.decode(await reader.readexactly(n), type=BlockRequest)
                data, error = await self._block(req)
                header = msgspec.msgpack.encode(BlockHeader(ok=not error, length=len(data), error=error))
                if writer.is_closing():
                    return  # the asker gave up waiting: spend no link time on it
                async with self._sending:
                    if data:
                        await self.link.carry(len(data))
                    writer.write(_LEN.pack(len(header)) + header + data)
                    await asyncio.wait_for(writer.drain(), SEND_TIMEOUT_S)
                if data:
                    self.served_blocks += 1
                    if self.on_served is not None:
                        self.on_served(len(data))
        except (ConnectionError, TimeoutError, asyncio.IncompleteReadError, msgspec.DecodeError) as e:
            log.debug("block connection ended: %s", e)
        except Exception:  # an answer to nobody: the asker sees the connection end and falls back
            log.exception("serving blocks failed")
        finally:
            self._writers.discard(writer)
            writer.close()

    async def _block(self, req: BlockRequest) -> tuple[bytes, str]:
        holding = self.sets.get(req.set_id)
        if holding is None:
            # A target may ask before this node's own order to receive the set reached it
            # (the orders go out together): wait a little for it rather than be taken for dead.
            deadline = time.monotonic() + OFFER_WAIT_S
            self.awaiting_offer += 1
            try:
                while (holding := self.sets.get(req.set_id)) is None:
                    try:
                        await asyncio.wait_for(self._offered.wait(), max(0.0, deadline - time.monotonic()))
                    except TimeoutError:
                        return b"", f"set {req.set_id} is not here"
            finally:
                self.awaiting_offer -= 1
        if not 0 <= req.index < holding.blocks.blocks:
            return b"", f"set {req.set_id} has no block {req.index}"
        if not await holding.wait_for(req.index, self.wait_s):
            return b"", f"block {req.index} of {req.set_id} did not arrive here in time"
        try:
            return await asyncio.to_thread(read_block, holding.root, holding.blocks, req.index), ""
        except OSError as e:  # evicted from under us: the asker goes elsewhere
            return b"", f"block {req.index} of {req.set_id} is unreadable here: {e}"


class BlockSource(Protocol):
    """Where blocks come from: a peer's server, or the model store (a directory here; an
    object store is another implementation)."""

    name: str

    async def get(self, blocks: BlockSet, index: int, timeout_s: float) -> bytes: ...

    async def close(self) -> None: ...


class PeerSource:
    """A block server at `host:port`, over one connection, one block at a time."""

    def __init__(self, addr: str) -> None:
        self.name = addr
        self._conn: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None

    async def get(self, blocks: BlockSet, index: int, timeout_s: float) -> bytes:
        return await asyncio.wait_for(self._get(blocks, index), timeout_s)

    async def _get(self, blocks: BlockSet, index: int) -> bytes:
        if self._conn is None:
            host, port = self.name.rsplit(":", 1)
            self._conn = await asyncio.open_connection(host, int(port))
        reader, writer = self._conn
        req = msgspec.msgpack.encode(BlockRequest(blocks.set_id, index))
        writer.write(_LEN.pack(len(req)) + req)
        await writer.drain()
        (n,) = _LEN.unpack(await reader.readexactly(_LEN.size))
        header = msgspec.msgpack.decode(await reader.readexactly(n), type=BlockHeader)
        if not header.ok:
            raise LookupError(header.error)
        return await reader.readexactly(header.length)

    async def close(self) -> None:
        if self._conn is not None:
            self._conn[1].close()
            self._conn = None


class DirectoryStore:
    """The model store as a directory this node can read (the default store)."""

    def __init__(self, root: Path, name: str = "store") -> None:
        self.root = root
        self.name = name

    async def get(self, blocks: BlockSet, index: int, timeout_s: float) -> bytes:
        return await asyncio.wait_for(asyncio.to_thread(read_block, self.root, blocks, index), timeout_s)

    async def close(self) -> None:
        return None


@dataclass
class Received:
    blocks: int = 0
    nbytes: int = 0
    refetched: int = 0
    """Blocks that came from a fallback: their planned source failed or sent a bad block."""
    corrupt: int = 0
    """Blocks that arrived and failed their checksum (each refetched)."""
    dead_sources: list[str] = field(default_factory=list)
    seconds: float = 0.0


async def receive(
    holding: Holding,
    feeds: Sequence[tuple[int, str]],
    sources: Mapping[str, BlockSource],
    fallbacks: Sequence[str],
    timeout_s: float = 30.0,
    on_block: Callable[[int], Awaitable[None]] | None = None,
) -> Received:
    """Bring the `feeds` (block, source name), in order, into `holding`: each block checked
    before it is written and marked (and so served on); a failed source is dropped for the
    rest of the transfer and its blocks come from `fallbacks`, in order. The next block is
    asked for while the last one is written, so the link does not idle for the write."""
    t0 = time.perf_counter()
    out = Received()
    bs = holding.blocks
    await asyncio.to_thread(prepare, holding.root, bs)
    dead: set[str] = set()
    checked: asyncio.Queue[tuple[int, bytes] | None] = asyncio.Queue(maxsize=1)

    async def fetch() -> None:
        for index, planned in feeds:
            if index in holding.have:
                continue
            tried = [planned, *(f for f in fallbacks if f != planned)]
            for name in tried:
                if name in dead or name not in sources:
                    continue
                try:
                    data = await sources[name].get(bs, index, timeout_s)
                except (OSError, TimeoutError, LookupError, asyncio.IncompleteReadError, ValueError) as e:
                    log.warning(
                        "source %s failed for block %d of %s (%s): routing around it", name, index, bs.set_id, e
                    )
                    dead.add(name)
                    await sources[name].close()
                    continue
                if not await asyncio.to_thread(block_ok, bs, index, data):
                    log.warning("block %d of %s from %s failed its checksum: refetching", index, bs.set_id, name)
                    out.corrupt += 1
                    continue
                out.refetched += name != planned
                await checked.put((index, data))
                break
            else:
                raise TransferFailed(f"no source could supply block {index} of {bs.set_id} (tried {tried})")
        await checked.put(None)

    async def write() -> None:
        while (item := await checked.get()) is not None:
            index, data = item
            await asyncio.to_thread(write_block, holding.root, bs, index, data)
            await holding.mark(index)
            out.blocks += 1
            out.nbytes += len(data)
            if on_block is not None:
                await on_block(index)

    try:
        async with asyncio.TaskGroup() as tasks:
            tasks.create_task(fetch())
            tasks.create_task(write())
    except BaseExceptionGroup as group:  # what failed, not the task group around it
        raise group.exceptions[0] from None
    finally:
        out.dead_sources = sorted(dead)
        out.seconds = time.perf_counter() - t0
    return out

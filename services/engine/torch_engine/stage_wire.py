"""Stages over TCP: `StageServer` runs one `Stage` for its askers; `Pipeline` generates through
a list of them (FaaScale §4.3: nodes that hold complementary parts of a model serve together
before any holds all of it).

A frame is a 4-byte length, a msgpack `StageFrame`, then the tensor's raw bytes. Each step of
a generation sends the new token ids to the first stage, its hidden states to the next, and so
on; the last stage answers with the logits of the last position, and the pipeline's sampler
(the engine's own) picks the token. The pipeline is the hub: activations go through it rather
than stage to stage (one more hop per stage; what it buys is that a stage needs to know no
other).
"""

from __future__ import annotations

import asyncio
import struct
import uuid
from collections.abc import AsyncIterator, Sequence

import msgspec
import numpy as np
import torch

from services.engine.sampling import Sampler
from services.engine.torch_engine.stages import Stage
from shared.messages import SamplingParams
from shared.tcp import Listener

_LEN = struct.Struct(">I")
TIMEOUT_S = 60.0
"""Longest a stage may take to answer one step (a prefill of a long prompt on a busy node)."""


class StageFrame(msgspec.Struct, frozen=True):
    session: str
    op: str
    """"forward" (a tensor follows), "drop" (end the session's KV cache), or "result"."""
    dtype: str = ""
    shape: tuple[int, ...] = ()
    length: int = 0
    error: str = ""


class StageFailed(Exception):
    pass


def _to_bytes(t: torch.Tensor) -> tuple[str, tuple[int, ...], bytes]:
    t = t.detach().contiguous().cpu()
    return str(t.dtype).removeprefix("torch."), tuple(t.shape), t.view(torch.uint8).numpy().tobytes()


def _from_bytes(dtype: str, shape: tuple[int, ...], data: bytes) -> torch.Tensor:
    raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return raw.view(getattr(torch, dtype)).reshape(shape)


async def _send(writer: asyncio.StreamWriter, frame: StageFrame, data: bytes = b"") -> None:
    header = msgspec.msgpack.encode(frame)
    writer.write(_LEN.pack(len(header)) + header + data)
    await writer.drain()


async def _recv(reader: asyncio.StreamReader) -> tuple[StageFrame, bytes]:
    (n,) = _LEN.unpack(await reader.readexactly(_LEN.size))
    frame = msgspec.msgpack.decode(await reader.readexactly(n), type=StageFrame)
    return frame, await reader.readexactly(frame.length) if frame.length else b""


class StageServer(Listener):
    """Serves one stage: one forward pass at a time (in a thread: the loop keeps reading).
    Closed, it ends every connection (its sessions' caches go with it)."""

    def __init__(self, stage: Stage) -> None:
        self.stage = stage
        self._lock = asyncio.Lock()
        self._askers: set[asyncio.Task[object]] = set()
        """One task per connection (asyncio's server runs each handler in a task)."""

    async def _end_connections(self) -> None:
        for task in list(self._askers):
            task.cancel()
        await asyncio.gather(*self._askers, return_exceptions=True)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        sessions: set[str] = set()  # dropped when the asker goes, whether it said so or not
        task = asyncio.current_task()
        if task is not None:
            self._askers.add(task)
            task.add_done_callback(self._askers.discard)
        try:
            while True:
                try:
                    frame, data = await _recv(reader)
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                try:
                    async with self._lock:
                        if frame.op == "drop":
                            self.stage.drop(frame.session)
                            await _send(writer, StageFrame(frame.session, "result"))
                            continue
                        sessions.add(frame.session)
                        x = _from_bytes(frame.dtype, frame.shape, data)
                        y = await asyncio.to_thread(self.stage.forward, frame.session, x)
                    dtype, shape, out = _to_bytes(y)
                    await _send(writer, StageFrame(frame.session, "result", dtype, shape, len(out)), out)
                except (ConnectionError, asyncio.IncompleteReadError):
                    return
                except Exception as e:  # this step fails, told to the asker; the stage serves on
                    await _send(writer, StageFrame(frame.session, "result", error=f"{type(e).__name__}: {e}"))
        finally:
            for session in sessions:
                self.stage.drop(session)
            writer.close()


class Pipeline:
    """A generation through stages (addresses in layer order), over one connection each."""

    def __init__(self, addrs: Sequence[str]) -> None:
        self.addrs = list(addrs)
        self._conns: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    async def __aenter__(self) -> Pipeline:
        for addr in self.addrs:
            host, port = addr.rsplit(":", 1)
            try:
                self._conns.append(await asyncio.wait_for(asyncio.open_connection(host, int(port)), TIMEOUT_S))
            except (OSError, TimeoutError) as e:
                await self.__aexit__()
                raise StageFailed(f"stage {addr}: {type(e).__name__}: {e}") from e
        return self

    async def __aexit__(self, *_: object) -> None:
        for _reader, writer in self._conns:
            writer.close()
        self._conns.clear()

    async def step(self, session: str, x: torch.Tensor) -> torch.Tensor:
        """One forward pass of `session` through every stage: token ids [1, T] in, the last
        position's logits [V] out (each stage keeps the session's KV cache)."""
        for (reader, writer), addr in zip(self._conns, self.addrs, strict=True):
            dtype, shape, data = _to_bytes(x)
            try:
                await _send(writer, StageFrame(session, "forward", dtype, shape, len(data)), data)
                frame, out = await asyncio.wait_for(_recv(reader), TIMEOUT_S)
            except (ConnectionError, asyncio.IncompleteReadError, TimeoutError) as e:
                # A late answer would be read as the next one's: no connection is used again.
                await self.__aexit__()
                raise StageFailed(f"stage {addr}: {type(e).__name__}: {e}") from e
            if frame.error:
                raise StageFailed(f"stage {addr}: {frame.error}")
            x = _from_bytes(frame.dtype, frame.shape, out)
        return x

    async def generate(
        self, prompt_ids: Sequence[int], params: SamplingParams, eos_ids: frozenset[int] = frozenset()
    ) -> AsyncIterator[int]:
        """The completion's tokens, one per step through every stage (ending before an end of
        sequence, or after `max_tokens`); the stages' KV caches for it are dropped after."""
        session = uuid.uuid4().hex
        sampler = Sampler.of(params)
        context = list(prompt_ids)
        x = torch.tensor([context], dtype=torch.long)
        try:
            for _ in range(params.max_tokens):
                logits = await self.step(session, x)
                token = sampler.pick(np.asarray(logits, dtype=np.float32), context)
                if token in eos_ids and not params.ignore_eos:
                    return
                context.append(token)
                yield token
                x = torch.tensor([[token]], dtype=torch.long)
        finally:
            await self.drop(session)

    async def drop(self, session: str) -> None:
        """End the session's KV caches on every stage (best effort: a stage gone has none)."""
        for reader, writer in self._conns:
            try:
                await _send(writer, StageFrame(session, "drop"))
                await asyncio.wait_for(_recv(reader), TIMEOUT_S)
            except (ConnectionError, asyncio.IncompleteReadError, TimeoutError):
                pass

"""Stages over TCP (FaaScale §4.3: nodes holding complementary parts of a model serve it before any
holds all of it): `StageServer` runs one `Stage`, `Pipeline` is one generation through them, and
`PipelineBatch` serves a model through pipelines while its replica arrives. The pipeline is the
hub (a stage knows no other); requests interleave on the stages as sessions (§4.3's 2-D
pipelining). A frame: a 4-byte length, a msgpack `StageFrame`, then a safetensors blob."""

from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import struct
import threading
import uuid
from collections.abc import Callable, Coroutine, Iterable, Sequence
from typing import Any, TypeVar

import msgspec
import numpy as np
import safetensors.torch
import torch

from services.engine.batch_types import Step, check_fits, drain
from services.engine.torch_engine.guides import Guides, Row
from services.engine.torch_engine.stages import Stage
from shared.messages import FinishReason, SamplingParams
from shared.tcp import Listener

T = TypeVar("T")
_LEN = struct.Struct(">I")
TIMEOUT_S = 60.0
"""Longest a stage may take to answer one step (a prefill of a long prompt on a busy node)."""


class StageFrame(msgspec.Struct, frozen=True):
    session: str
    op: str
    """"forward" (a tensor follows), "drop" (end the session's KV cache), or "result"."""
    length: int = 0
    error: str = ""


class StageFailed(Exception):
    pass


async def _send(
    writer: asyncio.StreamWriter, session: str, op: str, t: torch.Tensor | None = None, error: str = ""
) -> None:
    data = b"" if t is None else safetensors.torch.save({"x": t.detach().contiguous().cpu()})
    header = msgspec.msgpack.encode(StageFrame(session, op, len(data), error))
    writer.write(_LEN.pack(len(header)) + header + data)
    await writer.drain()


async def _recv(reader: asyncio.StreamReader) -> tuple[StageFrame, torch.Tensor | None]:
    (n,) = _LEN.unpack(await reader.readexactly(_LEN.size))
    frame = msgspec.msgpack.decode(await reader.readexactly(n), type=StageFrame)
    return frame, safetensors.torch.load(await reader.readexactly(frame.length))["x"] if frame.length else None


class LoopThread:
    """An event loop on a thread of its own, for the worker's synchronous side."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True, name=name)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        """End what runs on it (each task unwinds: a pipeline drops its sessions), then the loop."""

        async def shutdown() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        try:
            self.run(shutdown(), 10)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=10)


class StageServer(Listener):
    """Serves one stage, one forward pass at a time (in a thread: the loop keeps reading). Closed,
    it ends every connection, and its sessions' caches with them."""

    def __init__(self, stage: Stage) -> None:
        self.stage = stage
        self._lock = asyncio.Lock()
        self._askers: set[asyncio.Task[object]] = set()

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
                    frame, x = await _recv(reader)
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                try:
                    async with self._lock:
                        if frame.op == "drop":
                            self.stage.drop(frame.session)
                            await _send(writer, frame.session, "result")
                            continue
                        if x is None:
                            raise ValueError("a forward frame without a tensor")
                        sessions.add(frame.session)
                        y = await asyncio.to_thread(self.stage.forward, frame.session, x)
                    await _send(writer, frame.session, "result", y)
                except (ConnectionError, asyncio.IncompleteReadError):
                    return
                except Exception as e:  # this step fails, told to the asker; the stage serves on
                    await _send(writer, frame.session, "result", error=f"{type(e).__name__}: {e}")
        finally:
            for session in sessions:
                self.stage.drop(session)
            writer.close()


class Pipeline:
    """One generation (a session) through stages (addresses in layer order), a connection each;
    leaving it drops the session's KV caches on every stage still there."""

    def __init__(self, addrs: Sequence[str]) -> None:
        self.addrs = list(addrs)
        self.session = uuid.uuid4().hex
        self._conns: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    async def __aenter__(self) -> Pipeline:
        for addr in self.addrs:
            host, port = addr.rsplit(":", 1)
            try:
                self._conns.append(await asyncio.wait_for(asyncio.open_connection(host, int(port)), TIMEOUT_S))
            except (OSError, TimeoutError) as e:
                self._close()
                raise StageFailed(f"stage {addr}: {type(e).__name__}: {e}") from e
        return self

    async def __aexit__(self, *_: object) -> None:
        for reader, writer in self._conns:
            try:
                await _send(writer, self.session, "drop")
                await asyncio.wait_for(_recv(reader), TIMEOUT_S)
            except (ConnectionError, asyncio.IncompleteReadError, TimeoutError):
                pass  # a stage gone has no caches left
        self._close()

    def _close(self) -> None:
        for _reader, writer in self._conns:
            writer.close()
        self._conns.clear()

    async def step(self, x: torch.Tensor) -> torch.Tensor:
        """One forward pass through every stage: token ids [1, T] in, the last position's
        logits [V] out (each stage keeps the session's KV cache)."""
        for (reader, writer), addr in zip(self._conns, self.addrs, strict=True):
            try:
                await _send(writer, self.session, "forward", x)
                frame, out = await asyncio.wait_for(_recv(reader), TIMEOUT_S)
            except (ConnectionError, asyncio.IncompleteReadError, TimeoutError) as e:
                self._close()  # a late answer would be read as the next one's
                raise StageFailed(f"stage {addr}: {type(e).__name__}: {e}") from e
            if frame.error or out is None:
                raise StageFailed(f"stage {addr}: {frame.error or 'no tensor'}")
            x = out
        return x


class PipelineBatch:
    """A `batch_types.Batch` whose forward passes run on remote stages: no gate, no KV cache
    here (the stages' nodes hold and run them)."""

    waited = 0.0
    kv_bytes = 0

    def __init__(
        self, stages: Sequence[str], tokenizer: object, vocab_size: int, eos_ids: Iterable[int], kv_tokens: int
    ) -> None:
        self.stages = list(stages)
        self.eos_ids = frozenset(eos_ids)
        self.kv_tokens = kv_tokens
        self.guides = Guides(tokenizer, vocab_size, self.eos_ids)
        self._out: queue.Queue[Step] = queue.Queue()
        self._runs: dict[str, concurrent.futures.Future[None]] = {}
        self._loop = LoopThread("pipeline")

    @property
    def active(self) -> int:
        return len(self._runs)

    @property
    def alive(self) -> bool:
        return self._loop.thread.is_alive()

    def set_threads(self, threads: int) -> None:
        pass  # nothing heavy runs here: the sampler's work per token

    def device_bytes(self) -> int:
        return 0

    def add(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        deadline: Callable[[int], float] | None = None,
        kv_tokens: int = 0,
    ) -> None:
        check_fits(len(prompt_ids), params.max_tokens, self.kv_tokens)
        coro = self._run(request_id, Row(params, list(prompt_ids), self.eos_ids, self.guides.start(params.guide)))
        self._runs[request_id] = run = asyncio.run_coroutine_threadsafe(coro, self._loop.loop)
        run.add_done_callback(lambda _: self._runs.pop(request_id, None))

    def cancel(self, request_id: str) -> None:
        run = self._runs.pop(request_id, None)
        if run is not None:
            run.cancel()

    def steps(self, timeout: float) -> list[Step]:
        return list(drain(self._out, timeout).values())

    def close(self) -> None:
        self._loop.stop()

    async def _run(self, request_id: str, row: Row) -> None:
        try:
            async with Pipeline(self.stages) as pipe:
                x = torch.tensor([row.context], dtype=torch.long)
                while row.finish is None:
                    token = row.pick(np.asarray(await pipe.step(x), dtype=np.float32))
                    text = () if row.finish is FinishReason.STOP else ((token, row.logprobs[-1]),)  # an end is not text
                    self._out.put(Step(request_id, text, row.finish))
                    x = torch.tensor([[token]], dtype=torch.long)
        except Exception as e:  # this request fails (a stage gone, a grammar refusal); others go on
            self._out.put(Step(request_id, (), None, f"{type(e).__name__}: {e}"))

"""The engine's side of its worker processes: each `Worker` reads its pipe on a thread of its
own and hands what arrives to the event loop; `WorkerPool` keeps `size` workers warm and bound
to nothing, refilled in the background whenever a start takes one (TIDAL §5: the process pool)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import logging
import multiprocessing
import os
import threading
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import replace
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING
from unittest import mock

from cuda_ext.ledger import Placement
from cuda_ext.progress import FillFailed, FillProgress, FillSignal
from services.engine.backends import Backend, WorkerSpec
from services.engine.node import Cancelled, WorkerDied
from services.engine.node_arena import NodeArena
from services.engine.step_gate import StepGate
from services.engine.worker_wire import (
    CancelRun,
    Chunk,
    Chunks,
    Done,
    DropAdapter,
    DropSession,
    Failure,
    Load,
    Loaded,
    Ready,
    Run,
    StageSpec,
    Started,
    TieredUp,
    TierUpNow,
)
from shared.messages import Artifact, Tier
from shared.process import run_worker

if TYPE_CHECKING:
    from services.engine.settings import EngineSettings

log = logging.getLogger(__name__)

_PAGE = os.sysconf("SC_PAGE_SIZE")


def _shmem_bytes(pid: int) -> int:
    """Resident shared memory (shmem and memfd pages) of a process (RssShmem, in kB)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("RssShmem:"):
                return int(line.split()[1]) * 1024
    return 0


class Worker:
    def __init__(self, backend: Backend, spec: WorkerSpec) -> None:
        """A process of `backend` started with `spec`; every backend speaks `worker_wire`."""
        self.arena = spec.arena if backend.tensor_arena else None
        self.owner = NodeArena.owner()  # its holdings' name in the node arena's book
        self.progress = FillProgress() if self.arena is not None else None
        """How far the engine's copy of its model's tensors has come (its forward pass waits on it)."""
        self._fill: asyncio.Future[Placement] | None = None
        """Its model's copy, still streaming in behind the first requests."""
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._gate, self._slot_lock = spec.gate, threading.Lock()
        self._slot = spec.gate.claim() if spec.gate is not None else -1  # in the headroom gate, freed at its end
        self.process = ctx.Process(
            target=run_worker,
            args=(backend.entry, *backend.args(spec, child, self._slot)),
            daemon=True,
            name=backend.process_name,
        )
        with mock.patch.dict(os.environ, backend.env(spec)):  # a spawned process copies it
            self.process.start()
        child.close()
        self._loop = asyncio.get_running_loop()
        self._ready: asyncio.Future[Ready] = self._loop.create_future()
        self._waiter: asyncio.Future[Loaded] | None = None
        self._streams: dict[str, asyncio.Queue[Chunk | Done | Failure | Started | WorkerDied]] = {}
        """Each request sent and not yet done: where its messages go."""
        self.dead = self._stopped = False
        self._ending = threading.Lock()
        self.tier: Tier | None = None  # of the model it serves
        self.on_tier_up: Callable[[TieredUp], None] | None = None
        self.tiering = False  # a tier-up was asked for and has not answered yet
        self.tier_up_failed = False
        """It stays on START (asking again would fail again, a core-second each)."""
        threading.Thread(target=self._read, args=(self._conn,), daemon=True, name="worker-reader").start()

    @property
    def pid(self) -> int:
        return int(self.process.pid or 0)

    def rss_bytes(self) -> int:
        """Its resident memory, less the node arena's pages (the arena's reservation counts them)."""
        try:
            with open(f"/proc/{self.pid}/statm") as f:
                rss = int(f.read().split()[1]) * _PAGE
            return rss - (_shmem_bytes(self.pid) if self.arena is not None else 0)
        except (OSError, ValueError, IndexError):
            return 0

    def _read(self, conn: Connection) -> None:  # on the reader thread
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                self._tell(self._on_death)
                return
            if not self._tell(self._on_message, msg):
                return

    def _tell(self, callback: Callable[..., None], *args: object) -> bool:
        """Run `callback` on the loop; False once the loop is closed (the engine stopped before
        its worker's pipe did: nobody is left to tell)."""
        try:
            self._loop.call_soon_threadsafe(callback, *args)
        except RuntimeError:
            return False
        return True

    def _on_message(self, msg: object) -> None:
        if isinstance(msg, Ready):
            if not self._ready.done():
                self._ready.set_result(msg)
        elif isinstance(msg, Loaded):
            if self._waiter is not None and not self._waiter.done():
                self._waiter.set_result(msg)
        elif isinstance(msg, TieredUp):
            self.tier = msg.tier
            self.tiering = False
            self.tier_up_failed = bool(msg.error)
            if self.on_tier_up is not None:
                self.on_tier_up(msg)
        elif isinstance(msg, Failure) and msg.request_id is None:
            if self._waiter is not None and not self._waiter.done():
                self._waiter.set_exception(RuntimeError(msg.message))
        elif isinstance(msg, Chunks | Chunk | Done | Failure | Started):
            for item in msg.items if isinstance(msg, Chunks) else (msg,):
                if (stream := self._streams.get(str(item.request_id))) is not None:
                    stream.put_nowait(item)

    def _let_go(self) -> None:
        """Its gate slot freed, its model's tensors left idle in the node's arena."""
        with self._slot_lock:  # the loop (on its death) and a stopping thread may both free it
            slot, self._slot = self._slot, -1
        if self._gate is not None and slot >= 0:
            self._gate.release(slot)
        if self.arena is not None:
            self.arena.release(self.owner)

    def _on_death(self) -> None:
        self.dead = True
        self._let_go()
        died = WorkerDied(f"worker {self.pid} exited")
        for fut in (self._ready, self._waiter):
            if fut is not None and not fut.done():
                fut.set_exception(died)
        for stream in self._streams.values():
            stream.put_nowait(died)

    async def ready(self, timeout_s: float) -> None:
        await asyncio.wait_for(asyncio.shield(self._ready), timeout_s)

    async def load(
        self,
        artifact: Artifact,
        cores: tuple[int, ...] | None,
        cache_dir: str | None,
        timeout_s: float,
        tier: Tier = Tier.STEADY,
        stages: tuple[str, ...] = (),
        stage: StageSpec | None = None,
        tensors: Mapping[str, int] | None = None,
        discard: bool = False,
        admit_bytes: int | None = None,
    ) -> Loaded:
        """`tensors` (digest → bytes in access order): where the node has one arena, the worker
        binds the model where its book places them, and the engine copies what is missing
        meanwhile. Done once the first `admit_bytes` are in (TIDAL Eq. 1's M_prefetch; None:
        all): the rest streams in behind the first requests."""
        load = Load(artifact, cores, cache_dir, tier, stages, stage)
        placement = None
        fill: asyncio.Future[Placement] | None = None
        admitted: asyncio.Future[None] = self._loop.create_future()
        others: list[concurrent.futures.Future[bool]] = []
        if self.arena is not None and self.progress is not None and tensors and not stages and stage is None:
            if self._fill is not None:  # the last load's copy first (a reload after a failed check)
                await asyncio.wait([self._fill])
            placement = self.arena.place(self.owner, tensors, discard)
            self.arena.begin_fill(placement)  # no await since the placement: nothing came between
            others = self.arena.pending(placement)
            if placement.copy:  # the engine copies it (whole before the load is done, unless streamed)
                copy = functools.partial(self.arena.fill, placement, load.checkpoint)
                if admit_bytes is not None:  # streamed: the worker follows the count
                    order = tuple(d for d in tensors if d in placement.copy)
                    number = self.progress.begin()
                    admit = functools.partial(self._loop.call_soon_threadsafe, admitted.set_result, None)
                    copy = functools.partial(copy, order, self.progress, number, admit_bytes, admit)
                    load = replace(load, fill=FillSignal(self.progress.path, number, order))
                fill = asyncio.ensure_future(asyncio.to_thread(copy))
                placement = replace(placement, copy=frozenset(), filled=placement.copy)  # the worker reads none
            load = replace(load, placement=placement)
        self._waiter = self._loop.create_future()
        self._conn.send(load)
        try:
            loaded = await asyncio.wait_for(self._waiter, timeout_s)
            for other in others:  # tensors another load is copying in: whole before any is read
                if not await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(other)), timeout_s):
                    raise FillFailed("tensors this model shares with another load did not arrive")
            if fill is not None:
                await asyncio.wait((fill, admitted), timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
                if fill.done():
                    fill.result()  # its error, where it failed
                elif not admitted.done():
                    raise TimeoutError(f"the copy of {artifact.artifact_id}'s first tensors took over {timeout_s} s")
        except BaseException:
            if placement is not None and self.arena is not None:
                self.arena.release(self.owner)  # a failed copy's tensors are evicted once idle
            if fill is not None:  # it ends on its own (holding its tensors till then); what failed is raised here
                fill.add_done_callback(lambda f: f.cancelled() or f.exception())
            raise
        finally:
            self._waiter = None
        if fill is not None and not fill.done():
            self._fill = fill
            fill.add_done_callback(self._streamed)
        self.tier = tier
        return loaded

    def _streamed(self, fill: asyncio.Future[Placement]) -> None:
        """The rest of a load's copy ended; failed, the model lacks tensors: the worker stops."""
        if self._fill is fill:
            self._fill = None
        if fill.cancelled() or fill.exception() is None:
            return
        log.error("worker %s: the streamed copy of its model failed (%s): stopping it", self.pid, fill.exception())
        self._loop.run_in_executor(None, self.stop)

    async def generate(
        self, run: Run, is_cancelled: Cancelled, on_start: Callable[[int], None] | None = None
    ) -> AsyncIterator[Chunk | Done]:
        """Chunks of one generation, then its `Done`; `on_start(batch size)` once it runs."""
        if is_cancelled():
            return
        if self.dead:
            raise WorkerDied(f"worker {self.pid} is gone")
        stream: asyncio.Queue[Chunk | Done | Failure | Started | WorkerDied] = asyncio.Queue()
        self._streams[run.request_id] = stream
        done = False
        try:
            try:
                self._conn.send(run)
            except (OSError, ValueError, TypeError) as e:  # TypeError: closed by a stop meanwhile
                raise WorkerDied(f"worker {self.pid} is gone ({e})") from e
            while not done:
                msg = await stream.get()
                done = isinstance(msg, Done | Failure)  # before the yield: a caller may stop reading at its Done
                if isinstance(msg, WorkerDied):
                    raise msg
                if isinstance(msg, Failure):
                    raise RuntimeError(msg.message)
                if isinstance(msg, Started):
                    if on_start is not None:
                        on_start(msg.batch)
                else:
                    yield msg
        finally:
            del self._streams[run.request_id]
            if not done and not self.dead:
                self._send(CancelRun(run.request_id))  # nobody reads it any more

    def cancel(self, request_id: str) -> None:
        """Stop this request, queued or running."""
        if request_id in self._streams:
            self._send(CancelRun(request_id))

    def _send(self, msg: object) -> None:
        # The worker gone (TypeError: closed by a stop meanwhile): its reader thread reports it.
        with contextlib.suppress(OSError, ValueError, TypeError):
            self._conn.send(msg)

    def tier_up(self) -> None:
        """Ask for the STEADY tier (`TierUpNow`); `tiering` until it answers."""
        if not self.dead and not self.tiering:
            self.tiering = True
            self._send(TierUpNow())

    def drop_session(self, session: str) -> None:
        self._send(DropSession(session))

    def drop_adapter(self, name: str) -> None:
        """Let a LoRA adapter go (its keep-alive passed); it is read again at its next request."""
        self._send(DropAdapter(name))

    def stop(self) -> None:
        """End the process; idempotent and safe from any thread (a second caller returns once
        the first has finished: its model's tensors are released by then)."""
        with self._ending:
            if self._stopped:
                return
            try:
                if self.process.is_alive():
                    self.process.terminate()
                    self.process.join(5)
                    if self.process.is_alive():
                        self.process.kill()
                        self.process.join()
                self._conn.close()
            finally:
                self._stopped = True
                self._let_go()


class WorkerPool:
    """`size` pre-warmed workers bound to no model."""

    def __init__(
        self,
        size: int,
        backend: Backend,
        spec: WorkerSpec,
        ready_timeout_s: float = 120.0,
        refill_delay_s: float = 0.0,
        spawn: Callable[[], Worker] | None = None,
    ) -> None:
        """`spawn` starts one worker (by default a process of `backend` with `spec`)."""
        self.size, self.arena = size, spec.arena
        self.ready_timeout_s, self.refill_delay_s = ready_timeout_s, refill_delay_s
        self._spawn = spawn or (lambda: Worker(backend, spec))
        self._kick = asyncio.Event()
        self.idle: list[Worker] = []
        self.warming: set[Worker] = set()
        self._pending = 0
        self._tasks: set[asyncio.Task[None]] = set()

    def refill(self, delay_s: float = 0.0) -> None:
        while len(self.idle) + self._pending < self.size:
            self._pending += 1
            task = asyncio.create_task(self._warm_one(delay_s))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def start_done(self) -> None:
        """The start that took a warm worker has its first token: warm the replacement now."""
        self._kick.set()

    async def _warm_one(self, delay_s: float = 0.0) -> None:
        if delay_s:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._kick.wait(), delay_s)
            self._kick.clear()
        worker = self._spawn()
        self.warming.add(worker)
        try:
            await worker.ready(self.ready_timeout_s)
            self.idle.append(worker)
        except Exception:
            log.exception("a worker failed to warm up")
            worker.stop()
        finally:
            self.warming.discard(worker)
            self._pending -= 1

    async def take(self) -> tuple[Worker, bool]:
        """A warm worker if there is one (True), else a new one started now (False)."""
        # The replacement warms once this start has its first token (or after the delay):
        # importing the runtime (≈ 0.3 s of CPU) would slow this very start's Load ≈ 0.25 s.
        while self.idle:
            worker = self.idle.pop()
            if not worker.dead:
                # Only this start's first token may release the replacement: a stale kick would
                # warm it at once, on the cores this start needs (measured: starts ≈ 0.2 s slower).
                self._kick.clear()
                self.refill(self.refill_delay_s)
                return worker, True
        worker = self._spawn()
        await worker.ready(self.ready_timeout_s)
        self.refill(self.refill_delay_s)
        return worker, False

    def close(self) -> None:
        """End every worker this pool started, warm or still warming."""
        for task in self._tasks:
            task.cancel()
        for w in [*self.idle, *self.warming]:
            w.stop()
        self.idle.clear()
        self.warming.clear()


def node_pool(settings: EngineSettings, backend: Backend) -> WorkerPool:
    """The node's pool of `backend` workers, with the node's headroom gate (one iteration at a
    time per share of cores one instance's threads fill) and, where it has one, arena."""
    cores = len(os.sched_getaffinity(0))
    if settings.cpu_quota > 0:
        cores = min(cores, max(1, int(settings.cpu_quota)))
    capacity = max(1, cores // max(1, settings.inference_threads))
    shared = backend.tensor_arena and settings.torch_shared_arena
    spec = WorkerSpec(
        settings.device,
        settings.inference_threads,
        prefault_bytes=settings.worker_prefault_mb << 20,
        max_batch=settings.max_batch,
        join_recompute_tokens=settings.join_recompute_tokens,
        gate=StepGate(multiprocessing.get_context("spawn"), capacity) if settings.interleave else None,
        arena_bytes=settings.torch_arena_bytes,
        kv_tokens=settings.torch_kv_tokens,
        arena=NodeArena.make(settings.torch_arena_bytes, settings.device) if shared else None,
    )
    return WorkerPool(settings.worker_pool_size, backend, spec, refill_delay_s=settings.worker_refill_delay_s)

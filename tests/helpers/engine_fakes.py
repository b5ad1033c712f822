"""Fakes of what the engine's parts are built with (services/engine/service.py): the node's
memory manager (a book kept here), the bus, a worker pool and its workers (no process, no
model). The parts themselves are the real ones."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from policy.eviction import Resident
from services.engine.backends import OPENVINO, Backend
from services.engine.memory import KvMemory
from services.engine.node import Bound, Cancelled, Node, Served
from services.engine.node_arena import NodeArena
from services.engine.pipelines import Pipelines
from services.engine.requests import Requests
from services.engine.settings import EngineSettings
from services.engine.starts import Starts
from services.engine.worker_wire import Chunk, Done, Loaded, Run
from shared.bus import encode
from shared.errors import TesseraError
from shared.messages import Artifact, ErrorCode, Message, ReserveResult


class FakeMemoryManager:
    """The memory manager's book: a region's reservation replaces its old size (`used_bytes`
    counts the old size until granted), as the station does."""

    def __init__(self, budget: int, regions: dict[str, int] | None = None) -> None:
        self.budget = budget
        self.regions = dict(regions or {})
        self.released: list[str] = []
        self.peak: dict[str, int] = {}
        """The most each region has been granted."""
        self.calls: list[tuple[str, int]] = []
        """Every reservation asked for, in order."""

    def _result(self, granted: bool) -> ReserveResult:
        return ReserveResult(granted=granted, used_bytes=sum(self.regions.values()), budget_bytes=self.budget)

    async def reserve(self, owner: str, nbytes: int) -> ReserveResult:
        self.calls.append((owner, nbytes))
        others = sum(n for o, n in self.regions.items() if o != owner)
        granted = others + nbytes <= self.budget
        if granted:
            self.regions[owner] = nbytes
            self.peak[owner] = max(self.peak.get(owner, 0), nbytes)
        return self._result(granted)

    async def release(self, owner: str) -> ReserveResult:
        self.released.append(owner)
        if owner == "*":
            self.regions.clear()
        self.regions.pop(owner, None)
        return self._result(True)

    async def done(self, owner: str) -> None:
        pass


class FakeBus:
    """Records what is published and replied; a request is answered by `answers[subject]`
    (a function of the message), else refused as a bus without responders is."""

    def __init__(self) -> None:
        self.published: list[tuple[str, Any]] = []
        self.replies: list[Any] = []
        self.answers: dict[str, Callable[[Any], Any]] = {}
        self.connected = asyncio.Event()

    async def publish(self, subject: str, message: Any) -> None:
        self.published.append((subject, message))

    async def request(self, subject: str, message: Any, reply_type: Any, timeout: float) -> Any:
        answer = self.answers.get(subject)
        if answer is None:
            raise TesseraError(ErrorCode.UNAVAILABLE, f"no service is listening on {subject}")
        return answer(message)

    async def reply(self, msg: Any, message: Any) -> None:
        self.replies.append(message)

    async def subscribe(self, subject: str, handler: Any = None, queue: str = "") -> None:
        pass

    def sent(self, subject: str) -> list[Any]:
        return [m for s, m in self.published if s == subject]


def msg(message: Message) -> SimpleNamespace:
    """A bus message carrying `message`, as a handler receives it."""
    return SimpleNamespace(data=encode(message), reply="inbox")


Script = Callable[[Run], Sequence[Chunk | Done | BaseException]]
"""What a fake worker's model answers a request: its chunks, then its `Done` (or an error
it raises)."""


@dataclass
class FakeWorker:
    """A worker with no process: a load answers at once, a request's output is `script`'s."""

    script: Script = lambda run: ()
    arena: NodeArena | None = None
    rss: int = 0
    pid: int = 4242
    dead: bool = False
    tier: Any = None
    tiering: bool = False
    tier_up_failed: bool = False
    on_tier_up: Any = None
    stopped: bool = False
    cancelled: list[str] = field(default_factory=list)
    runs: list[Run] = field(default_factory=list)
    dropped_adapters: list[str] = field(default_factory=list)
    owner: str = "w"
    load_error: BaseException | None = None

    def rss_bytes(self) -> int:
        return self.rss

    def stop(self) -> None:
        self.stopped = self.dead = True
        if self.arena is not None:
            self.arena.release(self.owner)

    def cancel(self, request_id: str) -> bool:
        self.cancelled.append(request_id)
        return True

    def drop_session(self, session: str) -> None:
        pass

    def drop_adapter(self, name: str) -> None:
        self.dropped_adapters.append(name)

    def tier_up(self) -> None:
        self.tiering = True

    async def load(self, artifact: Artifact, *args: Any, **kwargs: Any) -> Loaded:
        if self.load_error is not None:
            raise self.load_error
        self.tier = args[3] if len(args) > 3 else kwargs.get("tier")
        return Loaded(loaded_from_cache=True, load_s=0.01)

    async def generate(
        self, run: Run, is_cancelled: Cancelled, on_start: Callable[[int], None] | None = None
    ) -> AsyncIterator[Chunk | Done]:
        self.runs.append(run)
        if on_start is not None:
            on_start(1)
        for out in self.script(run):
            if isinstance(out, BaseException):
                raise out
            yield out


class FakePool:
    """A worker pool whose workers are `FakeWorker`s made by `make`."""

    def __init__(self, make: Callable[[], FakeWorker] = FakeWorker, arena: NodeArena | None = None) -> None:
        self.make = make
        self.arena = arena
        self.idle: list[FakeWorker] = []
        self.taken: list[FakeWorker] = []
        self.starts_done = 0

    async def take(self) -> tuple[FakeWorker, bool]:
        worker = self.make()
        self.taken.append(worker)
        return worker, True

    def start_done(self) -> None:
        self.starts_done += 1

    def refill(self) -> None:
        pass

    def close(self) -> None:
        pass


def settings(**overrides: Any) -> EngineSettings:
    return EngineSettings(**{"node_id": "n", "memory_wait_s": 0.0, "interleave": False, **overrides})


@dataclass
class Parts:
    """The engine's parts over fakes, wired as `EngineService` wires them."""

    node: Node
    memory: KvMemory
    starts: Starts
    pipelines: Pipelines
    requests: Requests
    manager: FakeMemoryManager
    bus: FakeBus
    pool: FakePool


def parts(
    manager: FakeMemoryManager,
    pool: FakePool | None = None,
    backend: Backend = OPENVINO,
    **overrides: Any,
) -> Parts:
    s = settings(**overrides)
    pool = pool or FakePool()
    bus = FakeBus()
    node = Node(s, backend, pool, bus)  # type: ignore[arg-type]
    memory = KvMemory(node, manager)
    return Parts(
        node, memory, Starts(node, memory), Pipelines(node, memory), Requests(node, memory), manager, bus, pool
    )


def artifact(aid: str = "a", weight_bytes: int = 100, kv_bytes_per_token: int = 1, context: int = 64) -> Artifact:
    return Artifact(
        artifact_id=aid,
        path=f"/nonexistent/{aid}",
        source_sha256="0" * 64,
        context_length=context,
        kv_bytes_per_token=kv_bytes_per_token,
        weight_bytes=weight_bytes,
    )


def bind(node: Node, aid: str, nbytes: int, reload_s: float = 1.0, users: int = 0, **worker: Any) -> Bound:
    """A worker bound to artifact `aid` on `node`, its weights `nbytes`, in use by `users`."""
    bound = Bound(
        FakeWorker(owner=aid, **worker),  # type: ignore[arg-type]
        artifact(aid, weight_bytes=nbytes),
        Loaded(loaded_from_cache=True, load_s=0.0),
        Resident(aid, nbytes, reload_s, 0.0, 0.0, users=users),
        "host",
        weights_reserved=nbytes,
    )
    node.bound[aid] = bound
    return bound


def serve(node: Node, model: str, bound: Bound, kv_reserved: int = 0, active: int = 0) -> Served:
    """An instance of `model` on `bound`, its KV reservation `kv_reserved`."""
    kv = node.kv_account(bound.artifact)
    kv.reserved_bytes = kv_reserved
    inst = node.instances[model] = Served(model, bound, 0.0, 0.0, kv)
    inst.prompts.update({f"running-{i}": 1 for i in range(active)})  # requests in flight
    return inst

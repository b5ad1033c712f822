"""A worker process's one loop, whatever engine it runs: the engine's pipe commands
(`worker_wire`), the queue, the batch's steps, every request's text (`text.py`) and its `Done`.

The engine is a `Batch` (`batch_types.py`), which makes tokens, and a `Binding`, which binds
models for it. The loop reads its pipe between looks at the batch (`POLL_S`), so a new request
joins, and a cancel ends one, at the batch's next step. A start's bounded core share
(`Load.cores`) holds until the worker is tiered up, when it gets every core back.
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Protocol, cast

from services.engine.batch_types import AdaptedBatch, AdapterLoad, Batch, Step
from services.engine.cpu_share import pin_all_threads
from services.engine.text import DecodeMany, StreamText
from services.engine.worker_wire import (
    CancelRun,
    Chunks,
    Done,
    DropAdapter,
    DropSession,
    Failure,
    Load,
    Loaded,
    Run,
    Started,
    TieredUp,
    TierUpNow,
)
from shared.messages import FinishReason

POLL_S = 0.005
"""Longest a look at the batch waits before the pipe is read again."""


@dataclass(frozen=True)
class Bound:
    loaded: Loaded
    batch: Batch
    decode_many: DecodeMany


class Binding(Protocol):
    """What binds models for the loop, one engine's. `wake_s`: idle, look at `tiered` this often
    (a tier building; None: on a command only); `build_window`: when a tier's build ran on the
    worker's cores (`Done.beside_build`; inf: none); `load_beside`: every `Load` first, raising
    to refuse it, answering one served beside the bound model (a pipeline stage), else None;
    `reopen`: a new batch for the bound model, its last one died; `tier_up`: `TierUpNow`'s
    answer, or None where it comes later from `tiered`, a tier-up finished since the last look."""

    @property
    def wake_s(self) -> float | None: ...

    @property
    def build_window(self) -> tuple[float, float]: ...

    def load_beside(self, load: Load) -> Loaded | None: ...

    def load(self, load: Load, threads: int) -> Bound: ...

    def reopen(self, threads: int) -> Batch: ...

    def release(self) -> None: ...

    def tier_up(self) -> TieredUp | None: ...

    def tiered(self) -> TieredUp | None: ...

    def drop_session(self, session: str) -> None: ...

    def close(self) -> None: ...


@dataclass
class _Live:
    run: Run
    started: float
    waited_at: float
    """The batch's gate wait counter at its start (`waited_first`: at its first token)."""
    waited_first: float
    batch: int
    """The most requests its steps ran beside."""
    generated: int = 0
    first: float | None = None
    prefill_tokens: int = 0
    adapter_load: AdapterLoad | None = None


class WorkerLoop:
    def __init__(
        self,
        conn: Connection,
        binding: Binding,
        threads: int,
        set_threads: Callable[[int], None] = lambda _: None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.conn = conn
        self.binding = binding
        self.threads = threads
        self.set_threads = set_threads
        self.clock = clock
        self.batch: Batch | None = None
        self.text: StreamText | None = None
        self.queue: deque[Run] = deque()
        self.live: dict[str, _Live] = {}
        self.broken = False
        """The batch raised: its next request gets a new one."""
        self.share = threads
        """The batch's threads now (a start's share until tiered up)."""
        self.all_cores = os.sched_getaffinity(0)

    def serve(self) -> None:
        try:
            while True:
                try:
                    if not self.live and not self.queue:
                        self.conn.poll(self.binding.wake_s)
                    self.read_commands()
                except (EOFError, OSError):
                    return
                self.turn()
        finally:
            if self.batch is not None:
                self.batch.close()
            self.binding.close()

    def turn(self, timeout: float = POLL_S) -> None:
        """A finished tier-up, the queue into the batch, one look at the batch."""
        if (tiered := self.binding.tiered()) is not None:
            self._unpin()
            self.conn.send(tiered)
        self._admit()
        if self.live:
            self.pump(timeout)

    def read_commands(self) -> None:
        while self.conn.poll(0):
            self.handle(self.conn.recv())

    def handle(self, cmd: object) -> None:
        try:
            if isinstance(cmd, Run):
                self.queue.append(cmd)
            elif isinstance(cmd, CancelRun):
                self._cancel(cmd.request_id)
            elif isinstance(cmd, Load):
                self._load(cmd)
            elif isinstance(cmd, TierUpNow):
                if (answer := self.binding.tier_up()) is not None:
                    self._unpin()  # the node is idle: a start's bounded share ends here
                    self.conn.send(answer)
            elif isinstance(cmd, DropSession):
                self.binding.drop_session(cmd.session)
            elif isinstance(cmd, DropAdapter):
                if self.batch is not None and hasattr(self.batch, "drop_adapter"):
                    cast(AdaptedBatch, self.batch).drop_adapter(cmd.name)
        except Exception as e:  # the engine turns this into an error for the request (or the load)
            self.conn.send(Failure(getattr(cmd, "request_id", None), _error(e)))

    # --- the batch -------------------------------------------------------------------------

    def _admit(self) -> None:
        if not self.queue:
            return
        if self.batch is None or self.text is None:
            return self._fail_queued("no model loaded in this worker")
        if self.broken or not self.batch.alive:  # an error inside the library ended it: anew
            try:
                self.batch.close()
                self.batch, self.broken = self.binding.reopen(self.share), False
            except Exception as e:  # no batch to run them: they fail, the next ones try again
                return self._fail_queued(_error(e))
        while self.queue:
            run = self.queue.popleft()
            try:
                self._add(self.batch, run)
            except Exception as e:  # refused (too long, a grammar that does not compile): alone
                self.conn.send(Failure(run.request_id, _error(e)))
                continue
            waited = self.batch.waited
            live = _Live(run, self.clock(), waited, waited, self.batch.active)
            self.live[run.request_id] = live
            self.text.open(run.request_id, run.stream_interval_s, run.params.stop)
            self.conn.send(Started(run.request_id, live.batch))

    @staticmethod
    def _add(batch: Batch, run: Run) -> None:
        if run.adapter is None:
            batch.add(run.request_id, run.prompt_ids, run.params, run.deadline, run.kv_tokens)
        elif hasattr(batch, "add_adapted"):
            adapted = cast(AdaptedBatch, batch)
            adapted.add_adapted(run.request_id, run.prompt_ids, run.params, run.deadline, run.kv_tokens, run.adapter)
        else:  # never the base's output for an adapter's request
            raise ValueError(
                f"`{run.adapter.name}` is a LoRA adapter, and this node's engine does not apply adapters "
                "(its model is served through other nodes' pipeline stages): request its base, or again "
                "once its replica is whole"
            )

    def pump(self, timeout: float) -> None:
        """One look at the batch: every request's new text in one `Chunks`, then the ends."""
        if self.batch is None or self.text is None:
            return
        ended: dict[str, FinishReason] = {}
        failed: dict[str, str] = {}
        try:
            for step in self.batch.steps(timeout):
                live = self.live.get(step.request_id)
                if live is not None:  # else cancelled
                    self._take(live, step)
                    if step.error:
                        failed[step.request_id] = step.error
                    elif step.finish is not None:
                        ended[step.request_id] = step.finish
            flushed = self.text.flush()
        except Exception as e:  # every request on it fails; the worker lives on, with a new batch
            self.broken = True
            return self._fail_live(_error(e))
        for rid, taken in flushed.stopped.items():
            if rid in failed or rid not in self.live:
                continue
            if rid not in ended:  # a stop string: the rest of its computation goes too
                self.batch.cancel(rid)
            self.live[rid].generated = taken
            ended[rid] = FinishReason.STOP
        if flushed.chunks:
            self.conn.send(Chunks(tuple(flushed.chunks)))
        for rid, error in failed.items():
            del self.live[rid]
            self.conn.send(Failure(rid, error))
        for rid, finish in ended.items():
            self.conn.send(self._done(self.live.pop(rid), finish))

    def _take(self, live: _Live, step: Step) -> None:
        assert self.batch is not None and self.text is not None
        live.batch = max(live.batch, len(self.live))
        live.prefill_tokens = max(live.prefill_tokens, step.prefill_tokens)
        live.adapter_load = step.adapter_load or live.adapter_load
        if step.tokens:
            if live.first is None:
                live.first, live.waited_first = self.clock(), self.batch.waited
            live.generated += len(step.tokens)
            self.text.write(step.request_id, step.tokens)
        if step.error or step.finish is not None:
            self.text.end(step.request_id)

    def _cancel(self, request_id: str) -> None:
        for run in self.queue:
            if run.request_id == request_id:  # not in the batch yet: it ends at once
                self.queue.remove(run)
                waited = self.batch.waited if self.batch is not None else 0.0
                self.conn.send(self._done(_Live(run, self.clock(), waited, waited, 1), FinishReason.CANCELLED))
                return
        live = self.live.pop(request_id, None)
        if live is None or self.batch is None or self.text is None:
            return
        self.batch.cancel(request_id)
        self.text.drop(request_id)
        self.conn.send(self._done(live, FinishReason.CANCELLED))

    def _done(self, live: _Live, finish: FinishReason) -> Done:
        """Its figures: prefill and decode net of the gate's waits (the performance model's)."""
        batch = self.batch
        waited = batch.waited if batch is not None else live.waited_at
        now = self.clock()
        first = live.first
        start, end = self.binding.build_window
        prompt = len(live.run.prompt_ids)
        return Done(
            request_id=live.run.request_id,
            finish_reason=finish,
            completion_tokens=live.generated,
            first_token_at=first,
            prompt_tokens=prompt,
            prefill_s=max(0.0, (first or now) - live.started - (live.waited_first - live.waited_at)),
            decode_s=max(0.0, now - first - (waited - live.waited_first)) if first is not None else 0.0,
            batch=live.batch,
            prefill_tokens=max(prompt, live.prefill_tokens),
            gated_s=max(0.0, waited - live.waited_at),
            beside_build=live.started < end and now > start,
            kv_allocated_bytes=batch.kv_bytes if batch is not None else 0,
            device_bytes=batch.device_bytes() if batch is not None else 0,
            adapter_load=live.adapter_load,
        )

    # --- models ------------------------------------------------------------------------------

    def _load(self, cmd: Load) -> None:
        beside = self.binding.load_beside(cmd)
        if beside is not None:
            self.conn.send(beside)
            return
        self._fail_live("the worker was bound to another model")
        self._fail_queued("the worker was bound to another model")
        if self.batch is not None:
            self.batch.close()
        self.batch, self.text, self.broken = None, None, False
        self.binding.release()
        threads = self.threads
        if cmd.cores:
            # The start's share beside the node's busy instances, until tiered up.
            pin_all_threads(set(cmd.cores))
            threads = min(threads, len(cmd.cores))
        self.set_threads(threads)
        self.share = threads
        bound = self.binding.load(cmd, threads)
        self.batch, self.text = bound.batch, StreamText(bound.decode_many, self.clock)
        self.conn.send(bound.loaded)

    def _fail_live(self, message: str) -> None:
        for rid in self.live:
            if self.text is not None:
                self.text.drop(rid)
            self.conn.send(Failure(rid, message))
        self.live.clear()

    def _fail_queued(self, message: str) -> None:
        while self.queue:
            self.conn.send(Failure(self.queue.popleft().request_id, message))

    def _unpin(self) -> None:
        if os.sched_getaffinity(0) != self.all_cores:
            pin_all_threads(self.all_cores)
        self.set_threads(self.threads)
        self.share = self.threads
        if self.batch is not None:
            self.batch.set_threads(self.threads)


def _error(e: Exception) -> str:
    return f"{type(e).__name__}: {e}"

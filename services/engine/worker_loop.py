"""A worker process's one loop, whatever engine it runs: the engine's pipe commands
(`worker_wire`), the requests waiting to join the batch, the batch's steps, every request's
text (`text.py`) and the `Done` that ends it.

The engine is two objects. A `Batch` (`batch_types.py`) makes tokens: requests join it at its
next step, and each look at it (`steps`) says what each request got since the last. A
`Binding` binds models for it: a `Load` gives the batch and the model's `decode_many`, a batch
that died is made anew, a `TierUpNow` is answered, a session is dropped. The loop reads its
pipe between looks at the batch (`POLL_S`), so a new request joins, and a cancel ends a
running one, at the batch's next step; each look's new text travels in one `Chunks`.

A start's bounded core share (`Load.cores`) is the loop's too: the load and the model's first
steps run on that many threads, pinned to those cores, until the worker is tiered up (the
engine's `TierUpNow`, sent once the whole node is idle, or a tier the binding built in the
background) and the loop gives it every core back.
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Protocol

from services.engine.batch_types import Batch, Step
from services.engine.cpu_share import pin_all_threads
from services.engine.text import DecodeMany, StreamText
from services.engine.worker_wire import (
    CancelRun,
    Chunk,
    Chunks,
    Done,
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
"""Longest the loop looks at the batch before it reads its pipe again (a step of a crowd
takes longer; a new request or a cancel waits at most this long to be seen)."""


@dataclass(frozen=True)
class Bound:
    """A model bound by a `Load`: what the engine is told, the batch that serves it, and its
    tokenizer's `decode_many` (the loop's text)."""

    loaded: Loaded
    batch: Batch
    decode_many: DecodeMany


class Binding(Protocol):
    """What binds models for the loop, one engine's (composed into the loop, not a base)."""

    @property
    def wake_s(self) -> float | None:
        """With nothing running, look at `tiered` at least this often (a tier building in the
        background); None: only when a command arrives."""
        ...

    @property
    def build_window(self) -> tuple[float, float]:
        """When a build of the worker's own (a tier) ran on its cores: a request that overlapped
        it is marked `Done.beside_build`. (inf, inf): none."""
        ...

    def load_beside(self, load: Load) -> Loaded | None:
        """Called first for every `Load`, with the bound model still serving: raise to refuse
        the load (the model stays); a load that binds no model in its place (a pipeline stage
        served beside it) is done here and answered; None: a model's load, `load` follows."""
        ...

    def load(self, load: Load, threads: int) -> Bound:
        """Bind `load`'s model (the last one released), its batch stepping on `threads`."""
        ...

    def reopen(self, threads: int) -> Batch:
        """A new batch for the bound model: its last one died (its requests failed)."""
        ...

    def release(self) -> None:
        """Let the bound model go, if any (its batch is closed)."""
        ...

    def tier_up(self) -> TieredUp | None:
        """`TierUpNow`: the answer now, or None where it comes later from `tiered`."""
        ...

    def tiered(self) -> TieredUp | None:
        """A tier-up finished since the last look (the loop tells the engine)."""
        ...

    def drop_session(self, session: str) -> None: ...

    def close(self) -> None:
        """The worker ends: whatever the binding runs beside the batch ends too."""
        ...


@dataclass
class _Live:
    """A request in the batch, as the loop streams it."""

    run: Run
    started: float
    waited_at: float
    """The batch's gate wait counter at its start."""
    waited_first: float
    """That counter at its first token (at its start until then)."""
    batch: int
    """The most requests its steps ran beside."""
    generated: int = 0
    first: float | None = None
    prefill_tokens: int = 0


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
        """The pre-warm's thread count: what the worker runs with outside a start's share."""
        self.set_threads = set_threads
        """Sets the runtime's threads for this process's own thread."""
        self.clock = clock
        self.batch: Batch | None = None
        self.text: StreamText | None = None
        self.queue: deque[Run] = deque()
        """Requests read from the pipe, not yet in the batch."""
        self.live: dict[str, _Live] = {}
        self.broken = False
        """The batch raised: its next request gets a new one."""
        self.share = threads
        """The threads the batch runs on now (a start's share until tiered up)."""
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
        """One round after the commands: a tier-up that finished, the queue into the batch,
        one look at the batch."""
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
        except Exception as e:  # the engine turns this into an error for the request (or the load)
            self.conn.send(Failure(getattr(cmd, "request_id", None), f"{type(e).__name__}: {e}"))

    # --- the batch -------------------------------------------------------------------------

    def _admit(self) -> None:
        """Queued requests join the batch (a new batch first where the last one died)."""
        if not self.queue:
            return
        if self.batch is None or self.text is None:
            while self.queue:
                self.conn.send(Failure(self.queue.popleft().request_id, "no model loaded in this worker"))
            return
        if self.broken or not self.batch.alive:  # an error inside the library ended it: anew
            try:
                self.batch.close()
                self.batch, self.broken = self.binding.reopen(self.share), False
            except Exception as e:  # no batch to run them: they fail, the next ones try again
                while self.queue:
                    self.conn.send(Failure(self.queue.popleft().request_id, f"{type(e).__name__}: {e}"))
                return
        while self.queue:
            run = self.queue.popleft()
            try:
                self.batch.add(run.request_id, run.prompt_ids, run.params, run.deadline, run.kv_tokens)
            except Exception as e:  # refused (too long, a grammar that does not compile): alone
                self.conn.send(Failure(run.request_id, f"{type(e).__name__}: {e}"))
                continue
            waited = self.batch.waited
            live = _Live(run, self.clock(), waited, waited, self.batch.active)
            self.live[run.request_id] = live
            self.text.open(run.request_id, run.stream_interval_s, run.params.stop)
            self.conn.send(Started(run.request_id, live.batch))

    def pump(self, timeout: float) -> None:
        """Look at the batch once (waiting up to `timeout` for a step) and stream what it made:
        every request's new text in one `Chunks`, then the `Failure` or `Done` of those that
        ended (after their last text)."""
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
            for rid in list(self.live):
                self.text.drop(rid)
                del self.live[rid]
                self.conn.send(Failure(rid, f"{type(e).__name__}: {e}"))
            return
        for rid, taken in flushed.stopped.items():
            if rid in failed or rid not in self.live:
                continue
            if rid not in ended:  # a stop string: the rest of its computation goes too
                self.batch.cancel(rid)
            self.live[rid].generated = taken
            ended[rid] = FinishReason.STOP
        chunks: list[Chunk] = flushed.chunks
        if chunks:
            self.conn.send(Chunks(tuple(chunks)))
        for rid, error in failed.items():
            del self.live[rid]
            self.conn.send(Failure(rid, error))
        for rid, finish in ended.items():
            self.conn.send(self._done(self.live.pop(rid), finish))

    def _take(self, live: _Live, step: Step) -> None:
        """A step's tokens into the request's figures and text."""
        assert self.batch is not None and self.text is not None
        live.batch = max(live.batch, len(self.live))
        live.prefill_tokens = max(live.prefill_tokens, step.prefill_tokens)
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
        """The request's end and its figures: its prefill and decode times net of the gate's
        waits (what the performance model needs), measured where it ran."""
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
        )

    # --- models ------------------------------------------------------------------------------

    def _load(self, cmd: Load) -> None:
        beside = self.binding.load_beside(cmd)
        if beside is not None:
            self.conn.send(beside)
            return
        for rid in [*(r.request_id for r in self.queue), *self.live]:
            self.conn.send(Failure(rid, "the worker was bound to another model"))
        self.queue.clear()
        self.live.clear()
        if self.batch is not None:
            self.batch.close()
        self.batch, self.text, self.broken = None, None, False
        self.binding.release()
        threads = self.threads
        if cmd.cores:
            # The start's share: its load and first steps on these cores alone, beside the
            # node's busy instances (`EngineSettings.start_cpu_share`), until tiered up.
            pin_all_threads(set(cmd.cores))
            threads = min(threads, len(cmd.cores))
        self.set_threads(threads)
        self.share = threads
        bound = self.binding.load(cmd, threads)
        self.batch, self.text = bound.batch, StreamText(bound.decode_many, self.clock)
        self.conn.send(bound.loaded)

    def _unpin(self) -> None:
        if os.sched_getaffinity(0) != self.all_cores:
            pin_all_threads(self.all_cores)
        self.set_threads(self.threads)
        self.share = self.threads
        if self.batch is not None:
            self.batch.set_threads(self.threads)

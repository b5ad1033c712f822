"""A worker process: the runtime imported and initialised, then bound to one model.

TIDAL §3, §5: the engine keeps workers pre-warmed (OpenVINO, its CPU plugin and the tokenizer
extension already loaded) so that a cold start's Init is off the critical path; a start binds
one to a model. One worker holds one loaded model (an artifact) and serves every model name
on that artifact. Unloading a model ends its worker, so its memory returns to the system
whole.

A start loads the artifact's START tier (cheap first pass, `services/loader/start_ir.py`);
when the engine says so (`TierUpNow`: the node has been idle a while), a background thread
loads the STEADY tier from the store and runs its first pass, and the worker swaps to it
between batches (no KV cache outlives a batch anyway).

Requests queue in the worker; whenever it is free, it runs what is queued as one batch
(`batch.py`), reading new commands between decode steps: a cancel stops its row after the
current token, and new requests join the running batch when that is cheap, else wait for
the next one.

The engine talks to it over a `multiprocessing` pipe (`worker_wire.py`).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections import deque
from collections.abc import Sequence
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING

import openvino as ov

from services.engine.batch import BatchItem, joinable, take_batch
from services.engine.core import needs_core, needs_logits
from services.engine.cpu_share import pin_all_threads
from services.engine.step_gate import StepGate
from services.engine.streams import Chunk, CoreStreams
from services.engine.worker_os import prefault_heap, touch_kernels, trim_heap
from services.engine.worker_wire import (
    NO_SLO_S,
    CancelRun,
    Chunks,
    Done,
    DropSession,
    Failure,
    Load,
    Loaded,
    Ready,
    Run,
    Started,
    TieredUp,
    TierUpNow,
)
from shared.messages import Artifact, FinishReason, Tier, TokenLogprob
from shared.process import die_with_parent

if TYPE_CHECKING:  # the worker imports it at start: its pre-warm, not the engine's
    from services.engine.core import EngineCore
    from services.engine.instance import Batcher, Detokenizer, LoadedModel


class _CoreBuild:
    """The continuous-batching core (`core.py`), built on a thread of its own while the worker
    serves its first requests on the materialized stateful tier. The build takes ≈ 2.4 s of
    CPU and cannot be materialized (`core.build_pipeline`), and on an idle node its warm-up
    crowd ≈ 2.5 s more (`core.warm_up`); the library releases the GIL for both, so the worker
    keeps serving meanwhile."""

    def __init__(self, artifact: Artifact, device: str, threads: int, warm: bool) -> None:
        self.pipeline: object | None = None
        self.error = ""
        self.seconds = 0.0
        self.done = threading.Event()
        threading.Thread(
            target=self._run, args=(artifact, device, threads, warm), daemon=True, name="core-build"
        ).start()

    def _run(self, artifact: Artifact, device: str, threads: int, warm: bool) -> None:
        from services.engine.core import build_pipeline, warm_up

        t0 = time.monotonic()
        try:
            pipeline = build_pipeline(artifact.path, device, threads)
            if warm:
                warm_up(pipeline)
            self.pipeline = pipeline
        except Exception as e:  # the worker stays on its stateful tier, which serves correctly
            self.error = f"{type(e).__name__}: {e}"
        self.seconds = time.monotonic() - t0
        self.done.set()


class _GatedRequest:
    """An infer request whose every iteration passes the node's headroom gate first."""

    def __init__(self, request: ov.InferRequest, loop: _Loop) -> None:
        self._request = request
        self._loop = loop

    def infer(self, inputs: object) -> object:
        loop = self._loop
        assert loop.gate is not None
        t0 = time.monotonic()
        entered = loop.gate.enter(loop.slot, loop._deadline())
        loop.waited += time.monotonic() - t0
        try:
            return self._request.infer(inputs)
        finally:
            if entered:
                loop.gate.leave(loop.slot, loop._deadline())

    def __getattr__(self, name: str) -> object:
        return getattr(self._request, name)


class _Loop:
    """The worker's commands, its queue of requests and the batches run from it."""

    def __init__(
        self,
        conn: Connection,
        core: ov.Core,
        device: str,
        threads: int,
        max_batch: int,
        join_recompute_tokens: int = 0,
        gate: StepGate | None = None,
        slot: int = -1,
    ) -> None:
        self.conn = conn
        self.gate = gate
        self.slot = slot
        self.waited = 0.0
        """Seconds this worker's iterations have waited for the gate, in all."""
        self.emitted: dict[str, int] = {}
        """Tokens each running request has streamed (O of its headroom)."""
        self.waits: dict[str, list[float]] = {}
        """`waited` when each running request started, and when its first token came."""
        self.core = core
        self.device = device
        self.threads = threads
        self.max_batch = max(1, max_batch)
        self.join_recompute_tokens = join_recompute_tokens
        self._arriving = 0
        """Queue length seen at the last decode step (joins wait while it grows)."""
        self.batcher: Batcher | None = None
        """The stateful tier that serves a start's first requests (None once the core serves)."""
        self.engine: EngineCore | None = None
        """The continuous-batching core, once built: every request runs on it from then on."""
        self.streams: CoreStreams | None = None
        """The core's requests' text (detokenized together after each step)."""
        self.build: _CoreBuild | None = None
        self.artifact: Artifact | None = None
        self.detokenizer: Detokenizer | None = None
        self.build_window = (float("inf"), float("inf"))
        """When the core's build began and ended (its CPU time slows what runs meanwhile)."""
        self.for_core: list[Run] = []
        """Requests that wait for the core while it builds (`core.needs_core`)."""
        self.build_failed = False
        self.load: Load | None = None
        """What loaded the stateful tier (loaded again from it for requests that need logits)."""
        self.in_core: dict[str, tuple[Run, float]] = {}
        """Requests on the core: each with `waited` when it was added."""
        self.queue: deque[Run] = deque()
        self.running: dict[str, tuple[Run, float, int, int]] = {}
        """Requests of the running batch: each with when it joined, and the batch's width and
        prefilled positions then."""
        self.cancelled: set[str] = set()
        self.all_cores = os.sched_getaffinity(0)

    @property
    def loaded(self) -> LoadedModel | None:
        return self.batcher.loaded if self.batcher is not None else None

    @property
    def tier(self) -> Tier:
        """STEADY once the core serves; START while the stateful tier does."""
        return Tier.STEADY if self.engine is not None else Tier.START

    def serve(self) -> None:
        while True:
            self._adopt_core()
            try:
                busy = self.engine is not None and self.engine.has_work()
                if not self.queue and not busy and not self._wait():
                    continue
                self._read_commands()
            except (EOFError, OSError):
                return
            if self.queue:
                self._run_batch()
            elif self.engine is not None and self.engine.has_work():
                self._step_core()
            elif self.batcher is not None and self.engine is not None:
                # The core serves everything now: the stateful tier's memory goes back.
                self.batcher = None
                trim_heap()

    def _wait(self) -> bool:
        """Block until a command arrives (True); while the core builds, look at it every 50 ms."""
        return self.conn.poll(0.05 if self.build is not None else None)

    def _start_build(self, idle: bool = False) -> None:
        """Build the core now (the start's first batch is done, the node is `idle`, more
        requests wait than the start tier's batch took, or a request came that only the core
        serves). Only on an idle node does the build run its warm-up crowd too: beside
        requests, its CPU would be theirs, and the requests that asked for the core warm it up
        themselves."""
        if self.build is not None or self.engine is not None or self.artifact is None or self.build_failed:
            return
        self.build = _CoreBuild(self.artifact, self.device, self.threads, warm=idle)
        self.build_window = (time.monotonic(), float("inf"))

    def _adopt_core(self) -> None:
        """A finished build: queued requests move onto the core, and new ones go there."""
        build = self.build
        if build is None or not build.done.is_set():
            return
        self.build = None
        self.build_window = (self.build_window[0], time.monotonic())
        if build.pipeline is not None and self.detokenizer is not None:
            from services.engine.core import EngineCore

            self.engine = EngineCore(build.pipeline, self.detokenizer.eos_token_id)
            self.streams = CoreStreams(self.detokenizer.decode_many)
            for run in [*self.for_core, *self.queue]:
                if not needs_logits(run.params):  # those stay on the stateful tier
                    self._add_to_core(run)
            self.queue = deque(run for run in self.queue if needs_logits(run.params))
            self.for_core.clear()
        else:  # no core: what waited for it runs on the stateful tier after all (for good:
            # a build that failed once fails again, a core-second or more each time)
            self.build_failed = True
            self.queue.extend(self.for_core)
            self.for_core.clear()
        self.conn.send(TieredUp(self.tier, build.seconds, build.error))

    def _beside_build(self, t0: float, t1: float) -> bool:
        start, end = self.build_window
        return t0 < end and t1 > start

    def _read_commands(self) -> None:
        """Every command waiting in the pipe (called between decode steps too)."""
        while self.conn.poll(0):
            self._handle(self.conn.recv())

    def _between_steps(self) -> None:
        """Between two steps of the stateful tier's batch: commands, and a step of the core
        once it is there (its requests run alongside the batch until the batch ends)."""
        self._read_commands()
        if self.queue:
            self._start_build()  # more demand than the start tier's batch takes: the core, now
        self._adopt_core()
        if self.engine is not None and self.engine.has_work():
            self._step_core()

    def _add_to_core(self, run: Run) -> None:
        assert self.engine is not None and self.streams is not None
        rid = run.request_id
        # Stop strings are the library's (GenerationConfig.stop_strings): none here.
        self.engine.add(rid, run.prompt_ids, run.params, self.streams.open(rid, run.stream_interval_s))
        self.in_core[rid] = (run, self.waited)
        self.conn.send(Started(rid, len(self.engine)))

    def _step_core(self) -> None:
        assert self.engine is not None
        gate = self.gate if self.gate is not None and self.slot >= 0 else None
        entered = False
        if gate is not None:
            t0 = time.monotonic()
            entered = gate.enter(self.slot, self._deadline())
            self.waited += time.monotonic() - t0
        try:
            finished = self.engine.step()
            chunks = self.streams.flush() if self.streams is not None else []
        except Exception as e:  # every request on the core fails; the worker lives on
            for rid in list(self.in_core):
                self.engine.abort(rid)
                self.conn.send(Failure(rid, f"{type(e).__name__}: {e}"))
            self.in_core.clear()
            self.engine = self.streams = None
            return
        finally:
            if entered and gate is not None:
                gate.leave(self.slot, self._deadline())
        if chunks:
            self.conn.send(Chunks(tuple(chunks)))
        for out in finished:
            _, waited_at = self.in_core.pop(out.request_id, (None, self.waited))
            if out.error:
                self.conn.send(Failure(out.request_id, out.error))
                continue
            first = out.first_token_at
            self.conn.send(
                Done(
                    out.request_id,
                    out.finish_reason or FinishReason.STOP,
                    out.completion_tokens,
                    first,
                    out.prompt_tokens,
                    max(0.0, (first or out.finished_at) - out.added_at),
                    max(0.0, out.finished_at - first) if first is not None else 0.0,
                    out.peak_running,
                    out.prompt_tokens,
                    self.waited - waited_at,
                    self._beside_build(out.added_at, out.finished_at),
                    self.engine.kv_allocated_bytes(),
                )
            )
        if gate is not None and not self.engine.has_work() and not self.running:
            gate.idle(self.slot)

    def _handle(self, cmd: object) -> None:
        try:
            if isinstance(cmd, Run):
                if needs_logits(cmd.params):
                    # logit_bias, top_logprobs: read from the logits, which only the stateful
                    # tier has (loaded again if the core had let it go).
                    self._stateful()
                    self.queue.append(cmd)
                elif self.engine is not None:
                    self._add_to_core(cmd)
                elif cmd.params.guide is not None and self.build_failed:
                    # A grammar would be ignored on the start tier: say so, never ignore it.
                    self.conn.send(
                        Failure(
                            cmd.request_id,
                            "this instance cannot enforce structured output: "
                            "its continuous-batching core failed to build",
                        )
                    )
                elif needs_core(cmd.params) and self.build_failed:
                    self.queue.append(cmd)  # the start tier's sampler has seeds, penalties, top-k, min-p
                elif needs_core(cmd.params) and self.artifact is not None and not self.build_failed:
                    # The start tier has no grammar, and a seed names one sample of the core's
                    # sampler: the request waits for the core (built now if it is not yet)
                    # rather than run without what it asked for.
                    self.for_core.append(cmd)
                    self._start_build()
                else:
                    self.queue.append(cmd)
            elif isinstance(cmd, CancelRun):
                self._cancel(cmd.request_id)
            elif isinstance(cmd, TierUpNow):
                if self.engine is None and self.build is None and self.artifact is not None and not self.build_failed:
                    self._start_build(idle=True)
                elif self.build is None:  # nothing to do: say so, the engine waits for an answer
                    self.conn.send(TieredUp(self.tier, 0.0, "" if self.engine else "no model loaded"))
            elif isinstance(cmd, Load):
                from services.engine.instance import Batcher, LoadedModel

                t0 = time.monotonic()
                threads = self.threads
                if cmd.cores:
                    # The share is the runtime's thread count: the CPU plugin sets its own
                    # threads' affinity as it compiles and infers (measured: threads pinned
                    # here were back on every core after one forward pass), so pinning alone
                    # confines only the threads that are not its own.
                    pin_all_threads(set(cmd.cores))
                    threads = min(threads, len(cmd.cores))
                # The first forward pass (the CPU plugin repacks weights then) and the start
                # tier run on the bounded share; the core, built once the first batch is done,
                # gets every thread (and the pinning ends then).
                loaded = LoadedModel.load(self.core, cmd.artifact, self.device, threads, cmd.cache_dir, cmd.tier)
                self.batcher = Batcher(loaded)
                self.load = cmd
                self.artifact = cmd.artifact
                self.detokenizer = loaded.tokenizer
                self.conn.send(
                    Loaded(
                        loaded_from_cache=loaded.loaded_from_cache,
                        load_s=time.monotonic() - t0,
                        threads=int(loaded.compiled.get_property("INFERENCE_NUM_THREADS"))
                        if self.device == "CPU"
                        else 0,
                    )
                )
            elif isinstance(cmd, DropSession):
                if self.batcher is not None and self.batcher.drop(cmd.session):
                    trim_heap()
        except Exception as e:  # the engine turns this into an error for the request
            self.conn.send(Failure(getattr(cmd, "request_id", None), f"{type(e).__name__}: {e}"))

    def _stateful(self) -> None:
        """The stateful tier, loaded again from its compiled blob if the core had let it go."""
        if self.batcher is None and self.load is not None:
            from services.engine.instance import Batcher, LoadedModel

            cmd = self.load
            self.batcher = Batcher(
                LoadedModel.load(
                    self.core, cmd.artifact, self.device, self.threads, cmd.cache_dir, cmd.tier, self.detokenizer
                )
            )

    def _cancel(self, request_id: str) -> None:
        if self.engine is not None and self.engine.abort(request_id):
            return  # it ends CANCELLED at the core's next step
        if request_id in self.running:
            self.cancelled.add(request_id)
            return
        for run in [*self.queue, *self.for_core]:
            if run.request_id == request_id:
                (self.queue if run in self.queue else self.for_core).remove(run)
                self.conn.send(Done(request_id, FinishReason.CANCELLED, 0, None, len(run.prompt_ids)))
                return

    def _take(self) -> list[Run]:
        assert self.batcher is not None, "Run before Load"
        budget = self._kv_budget(self.queue)
        n = take_batch([(len(r.prompt_ids), r.params.max_tokens) for r in self.queue], self.max_batch, budget)
        return [self.queue.popleft() for _ in range(n)]

    def _deadline(self) -> float:
        """The most urgent running request's deadline: what this worker waits at the gate with."""
        return min(
            [
                *(run.deadline(self.emitted.get(rid, 0)) for rid, (run, *_) in self.running.items()),
                # A core request's deadline moves on with each token it generated, as a row's does:
                # held at its first token's, one instance decoding kept every turn of the gate.
                *(
                    run.deadline(self.engine.generated(rid) if self.engine is not None else 0)
                    for rid, (run, _) in self.in_core.items()
                ),
            ],
            default=time.monotonic() + NO_SLO_S,
        )

    def _gated(self, request: ov.InferRequest) -> _GatedRequest:
        return _GatedRequest(request, self)

    def _kv_budget(self, runs: Sequence[Run]) -> int:
        """Tokens a batch may hold: one context, or more where the engine grew the KV
        reservation for the requests it sent (`Run.kv_tokens`)."""
        assert self.batcher is not None
        return max([self.batcher.loaded.artifact.context_length, *(r.kv_tokens for r in runs)])

    def _start(self, runs: list[Run], width: int, longest: int) -> None:
        """`runs` enter a batch of `width` rows whose prefill pads them to `longest` tokens."""
        assert self.batcher is not None
        now = time.monotonic()
        for run in runs:
            self.batcher.names.add(run.session)
            self.running[run.request_id] = (run, now, width, width * longest)
            self.emitted[run.request_id] = 0
            self.waits[run.request_id] = [self.waited]
            self.conn.send(Started(run.request_id, width))

    def _join(self, rows: Sequence[tuple[int, int]]) -> list[BatchItem]:
        """Queued requests that join the running batch now (`batch.joinable`)."""
        if not self.queue or self.batcher is None:
            self._arriving = 0
            return []
        if len(self.queue) > self._arriving:
            # Still arriving (a burst reaches the worker over a few steps): wait a step, so
            # that they join in one re-prefill rather than one each.
            self._arriving = len(self.queue)
            return []
        self._arriving = 0
        n = joinable(
            rows,
            [(len(r.prompt_ids), r.params.max_tokens) for r in self.queue],
            self.max_batch,
            self._kv_budget(self.queue),
            self.join_recompute_tokens,
        )
        runs = [self.queue.popleft() for _ in range(n)]
        if runs:
            longest = max([c for c, _ in rows] + [len(r.prompt_ids) for r in runs])
            self._start(runs, len(rows) + n, longest)
        return [BatchItem(r.request_id, r.prompt_ids, r.params) for r in runs]

    def _run_batch(self) -> None:
        if self.batcher is None:
            for run in self.queue:
                self.conn.send(Failure(run.request_id, "no model loaded in this worker"))
            self.queue.clear()
            return
        runs = self._take()
        self._start(runs, len(runs), max(len(r.prompt_ids) for r in runs))
        conn = self.conn

        def emit(request_id: str, text: str, tokens: int, logprobs: tuple[TokenLogprob, ...]) -> None:
            if self.emitted.get(request_id) == 0:
                self.waits[request_id].append(self.waited)
            self.emitted[request_id] = self.emitted.get(request_id, 0) + tokens
            conn.send(Chunk(request_id, text, tokens, logprobs))

        try:
            results = self.batcher.generate(
                [BatchItem(r.request_id, r.prompt_ids, r.params) for r in runs],
                emit,
                self.cancelled.__contains__,
                runs[0].stream_interval_s,
                self._between_steps,
                self._join,
                self._gated if self.gate is not None and self.slot >= 0 else None,
            )
        except Exception as e:  # every request of the batch fails; the worker lives on
            for run, *_ in self.running.values():
                conn.send(Failure(run.request_id, f"{type(e).__name__}: {e}"))
            return
        finally:
            if self.gate is not None and not (self.engine is not None and self.engine.has_work()):
                self.gate.idle(self.slot)
            started = dict(self.running)
            waits = dict(self.waits)
            self.running.clear()
            self.cancelled.clear()
            self.emitted.clear()
            self.waits.clear()
        t_end = time.monotonic()
        # The start's first batch is done: build the core now. Not sooner: its ≈ 2.4 s of CPU
        # beside the first token's prefill and relay cost the cold start ≈ 0.1 s (measured).
        # Not later, only on an idle node (tried: `TierUpNow` alone, or demand): builds then
        # ran beside stateful batches far more often, and one such batch, as its core landed,
        # sampled from NaN logits in the suite (cause not found; see the closing note).
        self._start_build()
        if os.sched_getaffinity(0) != self.all_cores:
            pin_all_threads(self.all_cores)
        for res in results:
            run, t_run, width, positions = started[res.request_id]
            t_first = res.first_token_at
            at_start, at_first = (waits[res.request_id] + [self.waited])[:2]
            prefill_wait, decode_wait = at_first - at_start, self.waited - at_first
            conn.send(
                Done(
                    run.request_id,
                    res.finish_reason,
                    res.completion_tokens,
                    t_first,
                    len(run.prompt_ids),
                    max(0.0, (t_first or t_end) - t_run - prefill_wait),
                    max(0.0, t_end - t_first - decode_wait) if t_first is not None else 0.0,
                    width,
                    positions,
                    self.waited - at_start,
                    self._beside_build(t_run, t_end),
                )
            )


def serve(
    conn: Connection,
    device: str,
    threads: int,
    prefault_bytes: int = 0,
    max_batch: int = 1,
    join_recompute_tokens: int = 0,
    gate: StepGate | None = None,
    slot: int = -1,
) -> None:
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the engine decides when a worker ends
    # The pre-warm: everything a start would otherwise import and initialise.
    import openvino_tokenizers  # noqa: F401  (the detokenizer's string operations)

    core = ov.Core()
    touch_kernels(core, device, threads)
    prefault_heap(prefault_bytes)
    conn.send(Ready(pid=os.getpid()))
    _Loop(conn, core, device, threads, max_batch, join_recompute_tokens, gate, slot).serve()

"""A worker process: the runtime imported and initialised, then bound to one model.

TIDAL §3, §5: the engine keeps workers pre-warmed (OpenVINO, its CPU plugin and the tokenizer
extension already loaded) so that a cold start's Init is off the critical path; a start binds
one to a model. One worker holds one loaded model (an artifact) and one session (KV cache)
per model name served from it; generations run one at a time. Unloading a model ends its
worker, so its memory returns to the system whole.

A start loads the artifact's START tier (cheap first pass, `services/loader/start_ir.py`);
once the worker has had no command for `tier_up_idle_s`, a background thread loads the STEADY
tier from the store and runs its first pass, and the worker swaps to it between generations
(sessions are rebuilt: no KV cache outlives a generation anyway).

The engine talks to it over a `multiprocessing` pipe with the small dataclasses below (they
never leave the node, so they are not bus messages); cancellation of the running generation
is a shared value (the number of the run to stop), checked after every token.
"""

from __future__ import annotations

import ctypes
import os
import signal
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Protocol

import openvino as ov

from shared.messages import Artifact, FinishReason, SamplingParams, Tier

if TYPE_CHECKING:  # the worker imports it at start: its pre-warm, not the engine's
    from services.engine.instance import Instance, LoadedModel


@dataclass(frozen=True)
class Ready:
    pid: int


@dataclass(frozen=True)
class Load:
    artifact: Artifact
    cores: tuple[int, ...] | None
    """CPU cores the load and the first forward pass may use (a bounded share); None: all."""
    cache_dir: str | None = None
    """Where the verified compiled blob is (the loader's host cache); the store's when None."""
    tier: Tier = Tier.STEADY


@dataclass(frozen=True)
class Loaded:
    loaded_from_cache: bool
    load_s: float


@dataclass(frozen=True)
class TieredUp:
    """The worker now serves the STEADY tier (or, with `error`, stays on START)."""

    tier: Tier
    load_s: float
    error: str = ""


@dataclass(frozen=True)
class Run:
    seq: int
    """Numbers the runs of one worker: cancelling writes the running run's number into a
    shared value, so a late cancel can never stop the next run."""
    request_id: str
    session: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    stream_interval_s: float


@dataclass(frozen=True)
class Chunk:
    request_id: str
    text: str
    tokens: int


@dataclass(frozen=True)
class Done:
    request_id: str
    finish_reason: FinishReason
    completion_tokens: int
    first_token_at: float | None
    """time.monotonic() of the first text (CLOCK_MONOTONIC: comparable across processes)."""
    prompt_tokens: int = 0
    prefill_s: float = 0.0
    """Start of the run to its first token: the prefill, measured where it ran."""
    decode_s: float = 0.0
    """First token to the end of the run: (completion_tokens - 1) decode iterations."""


@dataclass(frozen=True)
class DropSession:
    session: str


@dataclass(frozen=True)
class Failure:
    request_id: str | None
    message: str


def _die_with_parent() -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


class SharedInt(Protocol):
    """A number in shared memory (multiprocessing's RawValue)."""

    value: int


class _Cancelled:
    def __init__(self, shared: SharedInt, seq: int) -> None:
        self._shared = shared
        self._seq = seq

    def is_set(self) -> bool:
        return bool(self._shared.value == self._seq)


def _pin_all_threads(cores: set[int]) -> None:
    """Set the CPU affinity of every thread of this process (sched_setaffinity on pid 0 moves
    only the calling thread; the runtime's pool threads would keep every core)."""
    for task in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(task), cores)
        except OSError:
            pass  # a thread that just ended


# glibc malloc settings for worker processes (read at process start, so set in the
# environment they are spawned with). One arena and no trimming keep the pages that
# `_prefault_heap` touched in the heap for the start's allocations to reuse; blocks from 32 MiB
# up still get their own mappings (a large block would otherwise pin the heap's top).
MALLOC_ENV = {
    "MALLOC_ARENA_MAX": "1",
    "MALLOC_TRIM_THRESHOLD_": str(1 << 40),
    "MALLOC_MMAP_THRESHOLD_": str(32 << 20),
}


def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return None
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    return libc


def _prefault_heap(nbytes: int) -> None:
    """TIDAL §5: move what a start would pay for into the pre-warm. A start allocates
    ≈ 200 MB (the imported model, then the CPU plugin's repacked weights on the first forward
    pass), and a fresh process takes a page fault for every 4 KiB it first writes: measured
    ≈ 54 000 faults, 0.06 s of a 0.28 s load + first pass. Touched here and freed into the
    heap (kept by MALLOC_ENV), those pages are reused without faulting."""
    libc = _libc()
    if libc is None or nbytes <= 0:
        return
    chunk = 1 << 20
    ptrs = []
    for _ in range(nbytes // chunk):
        ptr = libc.malloc(chunk)
        if not ptr:
            break
        ctypes.memset(ptr, 0, chunk)
        ptrs.append(ptr)
    for ptr in reversed(ptrs):
        libc.free(ptr)


def _trim_heap() -> None:
    """Give the heap's free pages back to the system (after a tier swap or a dropped session:
    MALLOC_ENV stops glibc from doing it on its own)."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


def _touch_kernels(core: ov.Core, device: str, threads: int) -> None:
    """TIDAL §5.1, proactive code loading with reduced input dimensions: compile and run a tiny
    matmul so that the device plugin, its thread pool and its JIT are initialised before any
    start needs them (measured: the first real compile in the process then takes ≈ 0.05–0.09 s
    less)."""
    import numpy as np
    from openvino import opset13 as ops

    x = ops.parameter([1, -1, 64], np.float32)
    w = ops.constant(np.ones((64, 64), dtype=np.float32))
    tiny = ov.Model([ops.matmul(x, w, False, True)], [x])
    config: dict[str, object] = {"INFERENCE_NUM_THREADS": threads} if device == "CPU" else {}
    compiled = core.compile_model(tiny, device, config)
    compiled.create_infer_request().infer({0: np.ones((1, 4, 64), dtype=np.float32)})


class _TierUp:
    """The STEADY tier, loaded on a thread of its own while the worker serves START."""

    def __init__(self, core: ov.Core, start: LoadedModel, device: str, threads: int) -> None:
        self.result: LoadedModel | None = None
        self.error = ""
        self.seconds = 0.0
        self.done = threading.Event()
        threading.Thread(
            target=self._run, args=(core, start, device, threads), daemon=True, name="tier-up"
        ).start()

    def _run(self, core: ov.Core, start: LoadedModel, device: str, threads: int) -> None:
        from services.engine.instance import LoadedModel, first_pass

        t0 = time.monotonic()
        try:
            steady = LoadedModel.load(core, start.artifact, device, threads, tier=Tier.STEADY,
                                      tokenizer=start.tokenizer)
            first_pass(steady.compiled)
            self.result = steady
        except Exception as e:  # stays on the START tier, which serves correctly
            self.error = f"{type(e).__name__}: {e}"
        self.seconds = time.monotonic() - t0
        self.done.set()


def worker_main(
    conn: Connection, cancel: SharedInt, device: str, threads: int, tier_up_idle_s: float | None = 0.5,
    prefault_bytes: int = 0,
) -> None:
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the engine decides when a worker ends
    # The pre-warm: everything a start would otherwise import and initialise.
    import openvino_tokenizers  # noqa: F401  (the detokenizer's string operations)

    from services.engine.instance import Instance, LoadedModel

    core = ov.Core()
    _touch_kernels(core, device, threads)
    _prefault_heap(prefault_bytes)
    conn.send(Ready(pid=os.getpid()))

    loaded: LoadedModel | None = None
    tier_up: _TierUp | None = None
    sessions: dict[str, Instance] = {}
    all_cores = os.sched_getaffinity(0)
    while True:
        if tier_up is not None and tier_up.done.is_set():
            # Between generations: swap tiers (the START model is freed with its sessions).
            if tier_up.result is not None:
                loaded = tier_up.result
                sessions.clear()
                _trim_heap()
            conn.send(TieredUp(loaded.tier if loaded else Tier.START, tier_up.seconds, tier_up.error))
            tier_up = None
        wait = None
        if tier_up is not None:
            wait = 0.05  # to swap soon after it is ready
        elif loaded is not None and loaded.tier == Tier.START and tier_up_idle_s is not None:
            wait = tier_up_idle_s
        try:
            if wait is not None and not conn.poll(wait):
                if tier_up is None and loaded is not None and loaded.tier == Tier.START:
                    tier_up = _TierUp(core, loaded, device, threads)
                continue
            cmd = conn.recv()
        except (EOFError, OSError):
            return
        try:
            if isinstance(cmd, Load):
                t0 = time.monotonic()
                if cmd.cores:
                    _pin_all_threads(set(cmd.cores))
                # The first forward pass (the CPU plugin repacks weights then) also runs under
                # the bounded share; all cores come back once it is done, in `Run`.
                loaded = LoadedModel.load(core, cmd.artifact, device, threads, cmd.cache_dir, cmd.tier)
                conn.send(Loaded(loaded_from_cache=loaded.loaded_from_cache, load_s=time.monotonic() - t0))
            elif isinstance(cmd, Run):
                assert loaded is not None, "Run before Load"
                inst = sessions.get(cmd.session)
                if inst is None:
                    now = time.time()
                    inst = sessions[cmd.session] = Instance(cmd.session, loaded, now, now)
                first: list[float] = []

                def emit(text: str, tokens: int, rid: str = cmd.request_id, first: list[float] = first) -> None:
                    if not first:
                        first.append(time.monotonic())
                    conn.send(Chunk(rid, text, tokens))

                t_run = time.monotonic()
                result = inst.generate(
                    cmd.prompt_ids, cmd.params, emit, _Cancelled(cancel, cmd.seq), cmd.stream_interval_s
                )
                t_end = time.monotonic()
                if os.sched_getaffinity(0) != all_cores:
                    _pin_all_threads(all_cores)
                t_first = first[0] if first else None
                conn.send(Done(cmd.request_id, result.finish_reason, result.completion_tokens, t_first,
                               len(cmd.prompt_ids), (t_first or t_end) - t_run,
                               t_end - t_first if t_first is not None else 0.0))
            elif isinstance(cmd, DropSession):
                dropped = sessions.pop(cmd.session, None)
                if dropped is not None:
                    dropped.release_kv()
                    _trim_heap()
        except Exception as e:  # the engine turns this into an error for the request
            conn.send(Failure(getattr(cmd, "request_id", None), f"{type(e).__name__}: {e}"))

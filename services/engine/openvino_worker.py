"""The OpenVINO worker process: the runtime imported and initialised (the pre-warm), then the
one worker loop (`worker_loop.py`) over the batch of both tiers (`tiered_batch.py`); it takes
the place of `worker_process.py` (`openvino_process.worker_main` calls `serve` here).

TIDAL §3, §5: the engine keeps workers pre-warmed (OpenVINO, its CPU plugin and the tokenizer
extension already loaded) so that a cold start's Init is off the critical path; a start binds
one to a model. One worker holds one loaded model (an artifact) and serves every model name
on that artifact; unloading a model ends its worker, so its memory returns to the system whole.
"""

from __future__ import annotations

import math
import os
import signal
import time
from multiprocessing.connection import Connection

import openvino as ov

from services.engine.core import Turn, no_turn
from services.engine.cpu_share import pin_all_threads
from services.engine.step_gate import StepGate
from services.engine.tiered_batch import TieredBatch
from services.engine.worker_loop import Bound, WorkerLoop
from services.engine.worker_os import prefault_heap, touch_kernels
from services.engine.worker_wire import Load, Loaded, TieredUp
from shared.messages import Tier
from shared.process import die_with_parent

BUILD_POLL_S = 0.05
"""How often an idle worker looks at a core build under way."""


class OpenVinoBinding:
    """Binds models for the worker loop (`worker_loop.Binding`): a `Load` opens a
    `TieredBatch` (the start tier now, the core built in the background)."""

    def __init__(
        self,
        core: ov.Core,
        device: str,
        threads: int,
        max_batch: int = 1,
        join_recompute_tokens: int = 0,
        gate: StepGate | None = None,
        slot: int = -1,
    ) -> None:
        self.core = core
        self.device = device
        self.threads = threads
        """The pre-warm's threads: what the core is built with (a start's share is for the start tier)."""
        self.max_batch = max_batch
        self.join_recompute_tokens = join_recompute_tokens
        self.gate = gate if gate is not None and slot >= 0 else None
        self.slot = slot
        self.all_cores = os.sched_getaffinity(0)
        self.batch: TieredBatch | None = None
        self._load: Load | None = None

    @property
    def wake_s(self) -> float | None:
        return BUILD_POLL_S if self.batch is not None and self.batch.building else None

    @property
    def build_window(self) -> tuple[float, float]:
        return self.batch.build_window if self.batch is not None else (math.inf, math.inf)

    def load_beside(self, load: Load) -> Loaded | None:
        return None

    def load(self, load: Load, threads: int) -> Bound:
        t0 = time.monotonic()
        self._load = load
        self.batch = self._open(load, threads)
        loaded = Loaded(
            loaded_from_cache=self.batch.loaded_from_cache,
            load_s=time.monotonic() - t0,
            threads=self.batch.load_threads,
        )
        return Bound(loaded, self.batch, self.batch.tokenizer.decode_many)

    def _open(self, load: Load, threads: int) -> TieredBatch:
        gate, slot = self.gate, self.slot
        turn: Turn = (lambda deadline: gate.turn(slot, deadline)) if gate is not None else no_turn
        return TieredBatch.open(
            self.core,
            load,
            self.device,
            self.threads,
            threads,
            turn,
            self.max_batch,
            self.join_recompute_tokens,
            # The start's bounded share ends with its first batch: the core's build gets every core.
            first_batch_done=self._unpin,
            idle=(lambda: gate.idle(slot)) if gate is not None else lambda: None,
        )

    def _unpin(self) -> None:
        if os.sched_getaffinity(0) != self.all_cores:
            pin_all_threads(self.all_cores)

    def reopen(self, threads: int) -> TieredBatch:
        if self._load is None:
            raise RuntimeError("no model loaded in this worker")
        self.batch = self._open(self._load, threads)
        return self.batch

    def release(self) -> None:
        self.batch = None
        self._load = None

    def tier_up(self) -> TieredUp | None:
        if self.batch is None:
            return TieredUp(Tier.START, 0.0, "no model loaded")
        return self.batch.tier_up_now()

    def tiered(self) -> TieredUp | None:
        return self.batch.poll_tier_up() if self.batch is not None else None

    def drop_session(self, session: str) -> None:
        if self.batch is not None:
            self.batch.release()

    def close(self) -> None:
        pass


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
    from services.engine.worker_wire import Ready

    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the engine decides when a worker ends
    # The pre-warm: everything a start would otherwise import and initialise.
    import openvino_tokenizers  # noqa: F401  (the detokenizer's string operations)

    core = ov.Core()
    touch_kernels(core, device, threads)
    prefault_heap(prefault_bytes)
    conn.send(Ready(pid=os.getpid()))
    binding = OpenVinoBinding(core, device, threads, max_batch, join_recompute_tokens, gate, slot)
    WorkerLoop(conn, binding, threads).serve()

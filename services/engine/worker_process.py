"""An OpenVINO worker process: the runtime imported and initialised (the pre-warm: TIDAL §3,
§5 keep a cold start's Init off the critical path), then bound to one model, served by the
worker loop through `OpenVinoBinding`. One worker holds one artifact and serves every name on
it; unloading a model ends its worker, so its memory returns to the system whole.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection

import openvino as ov

from services.engine.cpu_share import pin_all_threads, prefault_heap
from services.engine.instance import Detokenizer, LoadedModel
from services.engine.step_gate import StepGate, no_turn
from services.engine.tiered_batch import CoreFirst, TieredBatch, ir_vocab_size
from services.engine.worker_loop import Bound, WorkerLoop
from services.engine.worker_wire import Load, Loaded, Ready, TieredUp
from shared.messages import Tier

BUILD_POLL_S = 0.05
"""How often an idle worker looks at a core build under way (its `TieredUp` goes out then)."""


@dataclass
class OpenVinoBinding:
    """A `Load` imports the start tier's compiled blob into a `TieredBatch`, whose core then
    builds in the background (`worker_loop.Binding`)."""

    core: ov.Core
    device: str
    threads: int
    max_batch: int = 1
    join_recompute_tokens: int = 0
    gate: StepGate | None = None
    slot: int = -1
    batch: TieredBatch | None = None
    _load: Load | None = None
    _load_threads: int = 0
    """The threads the start tier was compiled with (`Loaded.threads`)."""
    _all_cores: set[int] = field(default_factory=lambda: os.sched_getaffinity(0))

    @property
    def wake_s(self) -> float | None:
        return BUILD_POLL_S if self.batch is not None and self.batch.building else None

    @property
    def build_window(self) -> tuple[float, float]:
        return self.batch.build_window if self.batch is not None else (math.inf, math.inf)

    def load_beside(self, load: Load) -> Loaded | None:
        return None  # an OpenVINO worker serves no pipeline stages

    def load(self, load: Load, threads: int) -> Bound:
        t0 = time.monotonic()
        self._load = load
        batch = self.reopen(threads)
        loaded = Loaded(batch.loaded_from_cache, time.monotonic() - t0, self._load_threads)
        return Bound(loaded, batch, batch.tokenizer.decode_many)

    def reopen(self, threads: int) -> TieredBatch:
        """The start tier loaded on `threads` (a start's share, or all), or `CoreFirst`; the
        core gets every thread."""
        load = self._load
        if load is None:
            raise RuntimeError("no model loaded in this worker")
        core, artifact, device = self.core, load.artifact, self.device
        tier = load.tier if artifact.start_tier else Tier.STEADY
        opened: LoadedModel | CoreFirst
        if artifact.start_tier:
            opened = LoadedModel.load(core, artifact, device, threads, load.cache_dir, tier)
            self._load_threads = int(opened.compiled.get_property("INFERENCE_NUM_THREADS")) if device == "CPU" else 0
        else:
            opened = CoreFirst(artifact, Detokenizer(artifact.path), ir_vocab_size(core, artifact))
            self._load_threads = 0
        tokenizer = opened.tokenizer  # the reload holds this alone: the start tier goes when let go

        def reload() -> LoadedModel:
            return LoadedModel.load(core, artifact, device, self.threads, load.cache_dir, tier, tokenizer)

        gate, slot = self.gate if self.slot >= 0 else None, self.slot
        self.batch = TieredBatch(
            opened,
            reload,
            device,
            self.threads,
            no_turn if gate is None else lambda deadline: gate.turn(slot, deadline),
            self.max_batch,
            self.join_recompute_tokens,
            first_batch_done=self._first_batch_done,
            idle=lambda: gate.idle(slot) if gate is not None else None,
        )
        return self.batch

    def _first_batch_done(self) -> None:
        # The start's first token is out: its share of cores ends (the core, built next,
        # gets every thread; OpenVINO's threads are fixed per compiled model).
        if os.sched_getaffinity(0) != self._all_cores:
            pin_all_threads(self._all_cores)

    def release(self) -> None:
        self.batch, self._load = None, None  # the loop closed it

    def tier_up(self) -> TieredUp | None:
        return self.batch.tier_up_now() if self.batch is not None else TieredUp(Tier.START, 0.0, "no model loaded")

    def tiered(self) -> TieredUp | None:
        return self.batch.poll_tier_up() if self.batch is not None else None

    def drop_session(self, session: str) -> None:
        if self.batch is not None:
            self.batch.release()

    def close(self) -> None:
        pass  # the loop closes the batch (and with it a core build under way)


def touch_kernels(core: ov.Core, device: str, threads: int) -> None:
    """TIDAL §5.1, proactive code loading with reduced inputs: a tiny matmul initialises the
    plugin, its threads and its JIT (the first real compile then takes ≈ 0.05–0.09 s less)."""
    import numpy as np
    from openvino import opset13 as ops

    x = ops.parameter([1, -1, 64], np.float32)
    w = ops.constant(np.ones((64, 64), dtype=np.float32))
    tiny = ov.Model([ops.matmul(x, w, False, True)], [x])
    config: dict[str, object] = {"INFERENCE_NUM_THREADS": threads} if device == "CPU" else {}
    compiled = core.compile_model(tiny, device, config)
    compiled.create_infer_request().infer({0: np.ones((1, 4, 64), dtype=np.float32)})


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
    import openvino_tokenizers  # noqa: F401  (the detokenizer's string operations)

    core = ov.Core()
    touch_kernels(core, device, threads)
    prefault_heap(prefault_bytes)
    conn.send(Ready(pid=os.getpid()))
    binding = OpenVinoBinding(core, device, threads, max_batch, join_recompute_tokens, gate, slot)
    WorkerLoop(conn, binding, threads).serve()

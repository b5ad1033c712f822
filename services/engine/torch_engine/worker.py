"""A torch worker: the torch engine behind the engine's pipe protocol (`batch_worker.py`).

One model at a time, bound from the artifact's torch checkpoint (materialized by the loader at
registration) into the node's tensor arena (`node_arena.py`: mapped from the engine, which
places the model and copies what is missing; or, without it, an arena of the worker's own); a
`Load` of another model (or of the same one again) releases the first to the arena, where its
tensors stay resident, idle, so the next start copies only what is missing (Tangram §3.1).

Requests run in one continuous batch (`batching.py`: transformers' paged-KV continuous
batching, every token picked by the engine's seeded sampler). Each step passes the node's
headroom gate (`step_gate.py`) as the OpenVINO worker's iterations do.
"""

from __future__ import annotations

import time
from multiprocessing.connection import Connection
from pathlib import Path

import torch

from cuda_ext import TensorArena
from services.engine.batch_types import Batch
from services.engine.batch_worker import BatchWorker
from services.engine.step_gate import StepGate
from services.engine.torch_engine.batching import ContinuousBatcher
from services.engine.torch_engine.engine import TorchEngine
from services.engine.worker_wire import Load, Loaded


def prewarm() -> None:
    """Import what binding a model would otherwise import on a start's path: transformers'
    auto classes and the decoder code of the default model's architecture."""
    import transformers.models.llama.modeling_llama  # noqa: F401
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer  # noqa: F401


class TorchWorker(BatchWorker):
    def __init__(
        self,
        conn: Connection,
        arena: TensorArena,
        gate: StepGate | None = None,
        slot: int = -1,
        max_batch: int = 16,
        kv_tokens: int = 8192,
    ) -> None:
        super().__init__(conn, gate, slot, max_batch, kv_tokens)
        self.arena = arena
        self.engine: TorchEngine | None = None

    def _open(self, checkpoint: Path, threads: int, t0: float, load: Load) -> Loaded:
        self.engine = TorchEngine.start(checkpoint, self.arena, load.placement, load.fill)
        self.tokenizer = self.engine.tokenizer
        self.batch = self._reopen(threads)
        return Loaded(
            # Nothing is compiled at start: the checkpoint was materialized at registration.
            loaded_from_cache=True,
            load_s=time.monotonic() - t0,
            threads=torch.get_num_threads(),
            reused_bytes=self.engine.loaded.reused_bytes,
            # The node's arena's book is the engine's: it knows what is resident.
            resident=tuple(sorted(self.arena.digests())) if self.arena.ledger is not None else (),
        )

    def _reopen(self, threads: int) -> Batch:
        assert self.engine is not None
        batch = ContinuousBatcher(self.engine, self.max_batch, self.kv_tokens, self.gate, self.slot)
        batch.set_threads(threads)  # its steps run on the library's thread, which keeps its own count
        return batch

    def _release(self) -> None:
        if self.engine is not None:
            self.engine.close()  # its tensors stay resident, idle: shared ones are not copied again
            self.engine = None

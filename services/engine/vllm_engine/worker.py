"""A vLLM worker: vLLM's engine behind the engine's pipe protocol (`batch_worker.py`).

One model at a time: a `Load` builds vLLM's engine on the artifact's torch checkpoint (the one
the loader materialized at registration), and the worker's requests run in its batch
(`batch.py`). vLLM keeps its own weights: Tangram's arena reuse is the torch engine's; a `Load`
of another model frees this one's engine and its cache.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from services.engine.batch_types import Batch
from services.engine.batch_worker import BatchWorker
from services.engine.vllm_engine.batch import VllmBatch
from services.engine.worker_wire import Load, Loaded


class VllmWorker(BatchWorker):
    checkpoint: Path | None = None

    def _open(self, checkpoint: Path, threads: int, t0: float, load: Load) -> Loaded:
        self.checkpoint = checkpoint
        self.batch = self._reopen(threads)
        return Loaded(loaded_from_cache=True, load_s=time.monotonic() - t0, threads=torch.get_num_threads())

    def _reopen(self, threads: int) -> Batch:
        assert self.checkpoint is not None
        batch = VllmBatch(self.checkpoint, self.max_batch, self.kv_tokens, self.gate, self.slot)
        batch.set_threads(threads)
        self.tokenizer = batch.tokenizer
        return batch

    def _release(self) -> None:
        self.checkpoint = None

"""A vLLM worker: vLLM's engine behind the engine's pipe protocol, as the worker loop's binding
(`worker_loop.py`).

One model at a time: a `Load` builds vLLM's engine on the artifact's torch checkpoint (the one
the loader materialized at registration), and the worker's requests run in its batch
(`batch.py`). vLLM keeps its own weights: Tangram's arena reuse is the torch engine's; a `Load`
of another model frees this one's engine and its cache. One tier: `TierUpNow` is answered at
once.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch

from services.engine.step_gate import StepGate
from services.engine.text import batch_decoder
from services.engine.vllm_engine.batch import VllmBatch
from services.engine.worker_loop import Bound
from services.engine.worker_wire import Load, Loaded, TieredUp
from shared.messages import Tier


class VllmBinding:
    """Binds models for the worker loop (`worker_loop.Binding`) on vLLM's engine."""

    wake_s: float | None = None
    build_window = (math.inf, math.inf)

    def __init__(
        self, gate: StepGate | None = None, slot: int = -1, max_batch: int = 16, kv_tokens: int = 8192
    ) -> None:
        self.gate = gate if gate is not None and slot >= 0 else None
        self.slot = slot
        self.max_batch = max(1, max_batch)
        self.kv_tokens = kv_tokens
        self.checkpoint: Path | None = None

    def load_beside(self, load: Load) -> Loaded | None:
        if load.stage is not None or load.stages:
            raise ValueError("a vLLM worker serves no pipeline stages (the torch engine's)")
        load.torch_checkpoint()  # refused before the bound model goes
        return None

    def load(self, load: Load, threads: int) -> Bound:
        t0 = time.monotonic()
        self.checkpoint = load.torch_checkpoint()
        batch = self.reopen(threads)
        loaded = Loaded(loaded_from_cache=True, load_s=time.monotonic() - t0, threads=torch.get_num_threads())
        return Bound(loaded, batch, batch_decoder(batch.tokenizer))

    def reopen(self, threads: int) -> VllmBatch:
        if self.checkpoint is None:
            raise RuntimeError("no model loaded in this worker")
        batch = VllmBatch(self.checkpoint, self.max_batch, self.kv_tokens, self.gate, self.slot)
        batch.set_threads(threads)
        return batch

    def release(self) -> None:
        self.checkpoint = None

    def tier_up(self) -> TieredUp:
        return TieredUp(Tier.TORCH, 0.0, "" if self.checkpoint is not None else "no model loaded")

    def tiered(self) -> TieredUp | None:
        return None

    def drop_session(self, session: str) -> None:
        pass  # vLLM's prefix cache is its own; no session state outlives a request

    def close(self) -> None:
        pass

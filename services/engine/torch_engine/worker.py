"""A torch worker: the torch engine behind the engine's pipe protocol, as the worker loop's
binding (`worker_loop.py`).

One model at a time, bound from the artifact's torch checkpoint (materialized by the loader at
registration) into the node's tensor arena (`node_arena.py`: mapped from the engine, which
places the model and copies what is missing; or, without it, an arena of the worker's own); a
`Load` of another model (or of the same one again) releases the first to the arena, where its
tensors stay resident, idle, so the next start copies only what is missing (Tangram §3.1).

Requests run in one continuous batch (`batching.py`: transformers' paged-KV continuous
batching, every token picked by the engine's seeded sampler). Each step passes the node's
headroom gate (`step_gate.py`) as the OpenVINO worker's iterations do.

Beside its model a worker may run pipeline stages (`Load.stage`: a layer range served to other
nodes), and a `Load.stages` serves a model through such stages on other nodes (FaaScale §4.3)
while its own replica is still arriving (`pipeline_batch.py`). There is no other tier to
build: `TierUpNow` is answered at once, on TORCH.
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from cuda_ext import TensorArena
from services.engine.batch_types import Batch, ends_of_sequence
from services.engine.step_gate import StepGate
from services.engine.text import batch_decoder
from services.engine.torch_engine.batching import ContinuousBatcher
from services.engine.torch_engine.engine import TorchEngine
from services.engine.worker_loop import Bound
from services.engine.worker_wire import Load, Loaded, StageSpec, TieredUp
from shared.messages import Tier

if TYPE_CHECKING:
    from services.engine.torch_engine.stage_wire import StageServer


def prewarm() -> None:
    """Import what binding a model would otherwise import on a start's path: transformers'
    auto classes and the decoder code of the default model's architecture."""
    import transformers.models.llama.modeling_llama  # noqa: F401
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer  # noqa: F401


class TorchBinding:
    """Binds models for the worker loop (`worker_loop.Binding`) on the tensor arena."""

    wake_s: float | None = None
    build_window = (math.inf, math.inf)

    def __init__(
        self,
        arena: TensorArena,
        gate: StepGate | None = None,
        slot: int = -1,
        max_batch: int = 16,
        kv_tokens: int = 8192,
    ) -> None:
        self.arena = arena
        self.gate = gate if gate is not None and slot >= 0 else None
        self.slot = slot
        self.max_batch = max(1, max_batch)
        self.kv_tokens = kv_tokens
        self.engine: TorchEngine | None = None
        self._make: Callable[[int], Batch] | None = None
        """Makes the bound model's batch (on so many threads); None: no model."""
        self._stages: list[StageServer] = []
        """The stage servers this worker runs (`Load.stage`), on a loop of their own."""
        self._stage_loop: tuple[asyncio.AbstractEventLoop, threading.Thread] | None = None

    def load_beside(self, load: Load) -> Loaded | None:
        checkpoint = load.torch_checkpoint()
        if load.stage is None:
            return None
        return self._serve_stage(checkpoint, load.stage, time.monotonic())

    def load(self, load: Load, threads: int) -> Bound:
        t0 = time.monotonic()
        checkpoint = load.torch_checkpoint()
        if load.stages:  # the stages this worker runs may be among them: they stay
            return self._open_pipeline(checkpoint, load.stages, t0)
        self._end_stages()
        self.engine = engine = TorchEngine.start(checkpoint, self.arena, load.placement, load.fill)
        self._make = self._batch
        loaded = Loaded(
            # Nothing is compiled at start: the checkpoint was materialized at registration.
            loaded_from_cache=True,
            load_s=time.monotonic() - t0,
            threads=torch.get_num_threads(),
            reused_bytes=engine.loaded.reused_bytes,
            # The node's arena's book is the engine's: it knows what is resident.
            resident=tuple(sorted(self.arena.digests())) if self.arena.ledger is not None else (),
        )
        return Bound(loaded, self._batch(threads), batch_decoder(engine.tokenizer))

    def _batch(self, threads: int) -> Batch:
        assert self.engine is not None
        batch = ContinuousBatcher(self.engine, self.max_batch, self.kv_tokens, self.gate, self.slot)
        batch.set_threads(threads)  # its steps run on the library's thread, which keeps its own count
        return batch

    def reopen(self, threads: int) -> Batch:
        if self._make is None:
            raise RuntimeError("no model loaded in this worker")
        return self._make(threads)

    def release(self) -> None:
        self._make = None
        if self.engine is not None:
            self.engine.close()  # its tensors stay resident, idle: shared ones are not copied again
            self.engine = None

    def tier_up(self) -> TieredUp:
        # One tier: nothing to build, and the engine waits for an answer.
        return TieredUp(Tier.TORCH, 0.0, "" if self._make is not None else "no model loaded")

    def tiered(self) -> TieredUp | None:
        return None

    def drop_session(self, session: str) -> None:
        pass  # no state outlives a request here: its KV blocks are freed as it ends

    def close(self) -> None:
        self._end_stages()

    def _open_pipeline(self, checkpoint: Path, stages: Sequence[str], t0: float) -> Bound:
        """Serve the model through the stages of an execution pipeline: the tokenizer and config
        from `checkpoint` (their files come first in a multicast), the forward passes remote."""
        from transformers import AutoConfig, AutoTokenizer

        from services.engine.torch_engine.pipeline_batch import PipelineBatch

        tokenizer = AutoTokenizer.from_pretrained(checkpoint)
        config = AutoConfig.from_pretrained(checkpoint)
        eos = ends_of_sequence(tokenizer, config.eos_token_id)

        def make(threads: int) -> Batch:
            return PipelineBatch(stages, tokenizer, config.vocab_size, eos, self.kv_tokens)

        self._make = make
        loaded = Loaded(loaded_from_cache=True, load_s=time.monotonic() - t0, threads=torch.get_num_threads())
        return Bound(loaded, make(0), batch_decoder(tokenizer))

    def _serve_stage(self, checkpoint: Path, spec: StageSpec, t0: float) -> Loaded:
        """Run a layer range of the model at `checkpoint` (possibly a copy still arriving: only
        the range's tensors are read) as a stage server for pipelines, beside the other stages
        this worker runs and the pipeline it may drive (one worker a node, not one a stage)."""
        from services.engine.torch_engine.stage_wire import StageServer
        from services.engine.torch_engine.stages import LayerRange, Stage

        stage = Stage.load(checkpoint, LayerRange(spec.lo, spec.hi, spec.layers, head=spec.head))
        if self._stage_loop is None:
            loop = asyncio.new_event_loop()
            thread = threading.Thread(target=loop.run_forever, daemon=True, name="stage-servers")
            thread.start()
            self._stage_loop = (loop, thread)
        server = StageServer(stage)
        addr = asyncio.run_coroutine_threadsafe(server.start(spec.host, 0), self._stage_loop[0]).result(30)
        self._stages.append(server)
        return Loaded(loaded_from_cache=True, load_s=time.monotonic() - t0, threads=torch.get_num_threads(), addr=addr)

    def _end_stages(self) -> None:
        """Stop the stage servers this worker runs (their sessions end with them)."""
        if self._stage_loop is None:
            return
        (loop, thread), self._stage_loop = self._stage_loop, None
        servers, self._stages = self._stages, []
        try:
            for server in servers:
                asyncio.run_coroutine_threadsafe(server.close(), loop).result(10)
        finally:
            loop.call_soon_threadsafe(loop.stop)
            thread.join(timeout=10)

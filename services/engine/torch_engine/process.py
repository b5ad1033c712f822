"""The torch worker process (spawned by name: `shared.process.run_worker`): one model at a time in
one continuous batch, bound in the node's tensor arena (or its own). Another model's `Load`
releases the first, its tensors resident, so the next start copies only what is missing (Tangram
§3.1). Beside it the worker may serve pipeline stages (`Load.stage`), or serve a model through
other nodes' stages while its replica arrives (`Load.stages`, FaaScale §4.3). One tier.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import ClassVar

# The pre-warm (TIDAL §5): torch, transformers' model code and the arena are imported as the
# worker spawns, before any model is bound, so that a start only reads and binds tensors.
import torch
import transformers.models.llama.modeling_llama  # noqa: F401  (the default model's decoder code)
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer  # noqa: F401

from cuda_ext import TensorArena
from cuda_ext.memory import ArenaHandle
from services.engine.batch_types import Batch, ends_of_sequence
from services.engine.step_gate import StepGate
from services.engine.text import batch_decoder
from services.engine.torch_engine.batching import ContinuousBatcher
from services.engine.torch_engine.engine import TorchEngine
from services.engine.torch_engine.lora import kept_shape
from services.engine.torch_engine.stage_wire import LoopThread, PipelineBatch, StageServer
from services.engine.torch_engine.stages import LayerRange, Stage
from services.engine.worker_loop import Bound, WorkerLoop
from services.engine.worker_wire import Load, Loaded, Ready, TieredUp
from shared.adapters import adapters_root, read_manifest
from shared.messages import Tier


@dataclass
class TorchBinding:
    """Binds models for the worker loop (`worker_loop.Binding`) on the tensor arena."""

    arena: TensorArena
    gate: StepGate | None = None
    slot: int = -1
    max_batch: int = 16
    kv_tokens: int = 8192
    engine: TorchEngine | None = None
    _make: Callable[[int], Batch] | None = None
    """Makes the bound model's batch on so many threads; None: no model."""
    _stages: list[StageServer] = field(default_factory=list)
    _stage_loop: LoopThread | None = None
    wake_s: ClassVar[float | None] = None
    build_window: ClassVar[tuple[float, float]] = (math.inf, math.inf)

    def load_beside(self, load: Load) -> Loaded | None:
        """A stage, served beside the model, reads its range's tensors only (more may be arriving)."""
        t0 = time.monotonic()
        checkpoint = load.torch_checkpoint()  # a load without one is refused here
        if (spec := load.stage) is None:
            return None
        server = StageServer(Stage.load(checkpoint, LayerRange(spec.lo, spec.hi, spec.layers, head=spec.head)))
        if self._stage_loop is None:
            self._stage_loop = LoopThread("stage-servers")
        addr = self._stage_loop.run(server.start(spec.host, 0), 30)
        self._stages.append(server)
        return Loaded(loaded_from_cache=True, load_s=time.monotonic() - t0, threads=torch.get_num_threads(), addr=addr)

    def load(self, load: Load, threads: int) -> Bound:
        t0 = time.monotonic()
        checkpoint = load.torch_checkpoint()
        if load.stages:  # the stages this worker runs may be among them: they stay
            # Only the tokenizer and config are read (their files come first in a multicast).
            tokenizer = AutoTokenizer.from_pretrained(checkpoint)
            config = AutoConfig.from_pretrained(checkpoint)
            eos = ends_of_sequence(tokenizer, config.eos_token_id)
            self._make = lambda _: PipelineBatch(load.stages, tokenizer, config.vocab_size, eos, self.kv_tokens)
            loaded = Loaded(loaded_from_cache=True, load_s=time.monotonic() - t0, threads=torch.get_num_threads())
            return Bound(loaded, self._make(0), batch_decoder(tokenizer))
        self._end_stages()
        self.engine = engine = TorchEngine.start(checkpoint, self.arena, load.placement, load.fill)

        root = adapters_root(load.artifact)
        lora = kept_shape(a for d in (sorted(root.iterdir()) if root.is_dir() else []) if (a := read_manifest(d)))

        def make(threads: int) -> Batch:
            batch = ContinuousBatcher(engine, max(1, self.max_batch), self.kv_tokens, self.gate, self.slot, lora=lora)
            batch.set_threads(threads)  # its steps run on the library's thread, which keeps its own count
            return batch

        self._make = make
        loaded = Loaded(
            loaded_from_cache=True,  # nothing is compiled: the checkpoint was materialized at registration
            load_s=time.monotonic() - t0,
            threads=torch.get_num_threads(),
            reused_bytes=engine.bound.loaded.reused_bytes,
            # The node's arena's book is the engine's: it knows what is resident.
            resident=tuple(sorted(self.arena.digests())) if self.arena.ledger is not None else (),
        )
        return Bound(loaded, make(threads), batch_decoder(engine.tokenizer))

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
        return TieredUp(Tier.TORCH, 0.0, "" if self._make is not None else "no model loaded")

    def tiered(self) -> TieredUp | None:
        return None

    def drop_session(self, session: str) -> None:
        pass  # no state outlives a request here: its KV blocks are freed as it ends

    def close(self) -> None:
        self._end_stages()

    def _end_stages(self) -> None:
        loop, self._stage_loop = self._stage_loop, None
        servers, self._stages = self._stages, []
        if loop is not None:
            try:
                for server in servers:
                    loop.run(server.close(), 10)
            finally:
                loop.stop()


def worker_main(
    conn: Connection,
    threads: int,
    arena: ArenaHandle | int,
    gate: StepGate | None = None,
    slot: int = -1,
    max_batch: int = 16,
    kv_tokens: int = 8192,
) -> None:
    torch.set_num_threads(max(1, threads))
    # The node's arena (mapped: CUDA IPC on a GPU), or one of its own of that many bytes.
    tensors = TensorArena.attach(arena) if isinstance(arena, ArenaHandle) else TensorArena(arena)
    conn.send(Ready(pid=os.getpid()))
    binding = TorchBinding(tensors, gate, slot, max_batch, kv_tokens)
    WorkerLoop(conn, binding, torch.get_num_threads(), torch.set_num_threads).serve()

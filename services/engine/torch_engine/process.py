"""The torch worker process's entry point (spawned by name: `shared.process.run_worker`), apart
from the worker itself: its pre-warm imports torch (≈ 1.5 s and a few hundred MB that only the
worker needs) before any model is bound."""

from __future__ import annotations

import os
from multiprocessing.connection import Connection

from cuda_ext.memory import ArenaHandle
from services.engine.step_gate import StepGate
from services.engine.worker_wire import Ready


def worker_main(
    conn: Connection,
    threads: int,
    arena: ArenaHandle | int,
    gate: StepGate | None = None,
    slot: int = -1,
    max_batch: int = 16,
    kv_tokens: int = 8192,
) -> None:
    # The pre-warm (TIDAL §5): torch, transformers' model code and the arena, before any model
    # is bound, so that a start only reads and binds tensors.
    import torch

    from cuda_ext import TensorArena
    from services.engine.torch_engine.worker import TorchBinding, prewarm
    from services.engine.worker_loop import WorkerLoop

    torch.set_num_threads(max(1, threads))
    prewarm()
    # The node's arena (mapped: CUDA IPC on a GPU), or one of its own of that many bytes.
    tensors = TensorArena.attach(arena) if isinstance(arena, ArenaHandle) else TensorArena(arena)
    conn.send(Ready(pid=os.getpid()))
    binding = TorchBinding(tensors, gate, slot, max_batch, kv_tokens)
    WorkerLoop(conn, binding, torch.get_num_threads(), torch.set_num_threads).serve()

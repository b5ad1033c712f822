"""The vLLM worker process's entry point (spawned by name: `shared.process.run_worker`): vLLM's
settings are made before its pre-warm imports it."""

from __future__ import annotations

import os
from multiprocessing.connection import Connection

from services.engine.step_gate import StepGate
from services.engine.worker_wire import Ready


def worker_main(
    conn: Connection,
    threads: int,
    gate: StepGate | None = None,
    slot: int = -1,
    max_batch: int = 16,
    kv_tokens: int = 8192,
) -> None:
    # vLLM's engine core in this process (the worker is already the engine's process for its
    # model), and its CPU threads left where a start's core share pins them.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    import torch

    # The pre-warm (TIDAL §5): vLLM and torch imported before any model is bound.
    from services.engine.vllm_engine.batch import VllmBinding
    from services.engine.worker_loop import WorkerLoop

    torch.set_num_threads(max(1, threads))
    conn.send(Ready(pid=os.getpid()))
    binding = VllmBinding(gate, slot, max_batch, kv_tokens)
    WorkerLoop(conn, binding, torch.get_num_threads(), torch.set_num_threads).serve()

"""The OpenVINO worker process's entry point and the environment it is spawned with, apart from
the worker itself (`worker_process.py`), so that the engine's main process can name it as a
spawn target without importing OpenVINO: a torch node's engine (a GPU machine's image may hold
no OpenVINO) never loads it."""

from __future__ import annotations

from multiprocessing.connection import Connection

from services.engine.step_gate import StepGate

# glibc malloc settings for worker processes (read at process start, so set in the
# environment they are spawned with). One arena and no trimming keep the pages that
# `worker_os.prefault_heap` touched in the heap for the start's allocations to reuse; blocks
# from 32 MiB up still get their own mappings (a large block would otherwise pin the heap's top).
MALLOC_ENV = {
    "MALLOC_ARENA_MAX": "1",
    "MALLOC_TRIM_THRESHOLD_": str(1 << 40),
    "MALLOC_MMAP_THRESHOLD_": str(32 << 20),
}


def worker_main(
    conn: Connection,
    device: str,
    threads: int,
    prefault_bytes: int = 0,
    max_batch: int = 1,
    join_recompute_tokens: int = 0,
    gate: StepGate | None = None,
    slot: int = -1,
) -> None:
    from services.engine.worker_process import serve

    serve(conn, device, threads, prefault_bytes, max_batch, join_recompute_tokens, gate, slot)

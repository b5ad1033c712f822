"""The environment the OpenVINO worker process (`worker_process.serve`) is spawned with, apart
from the worker itself so that the engine's main process reads it without importing OpenVINO: a
torch node's engine (a GPU machine's image may hold no OpenVINO) never loads it."""

from __future__ import annotations

# glibc malloc settings for worker processes (read at process start, so set in the
# environment they are spawned with). One arena and no trimming keep the pages that
# `worker_os.prefault_heap` touched in the heap for the start's allocations to reuse; blocks
# from 32 MiB up still get their own mappings (a large block would otherwise pin the heap's top).
MALLOC_ENV = {
    "MALLOC_ARENA_MAX": "1",
    "MALLOC_TRIM_THRESHOLD_": str(1 << 40),
    "MALLOC_MMAP_THRESHOLD_": str(32 << 20),
}

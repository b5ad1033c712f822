"""What a worker process does to itself and its host: threads pinned to its cores, a heap
touched before a start needs it and trimmed after, the device plugin's kernels loaded early
(TIDAL §5: the pre-warm takes what a start would otherwise pay for)."""

from __future__ import annotations

import ctypes

import openvino as ov


def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return None
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    return libc


def prefault_heap(nbytes: int) -> None:
    """TIDAL §5: a start's ≈ 200 MB of allocations took ≈ 54 000 page faults, 0.06 s of a
    0.28 s load + first pass; touched here and freed into the heap (kept by
    `cpu_share.MALLOC_ENV`), those pages are reused without faulting."""
    libc = _libc()
    if libc is None or nbytes <= 0:
        return
    chunk = 1 << 20
    ptrs = []
    for _ in range(nbytes // chunk):
        ptr = libc.malloc(chunk)
        if not ptr:
            break
        ctypes.memset(ptr, 0, chunk)
        ptrs.append(ptr)
    for ptr in reversed(ptrs):
        libc.free(ptr)


def trim_heap() -> None:
    """Give the heap's free pages back (`MALLOC_ENV` stops glibc from doing it on its own)."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


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

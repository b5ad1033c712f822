"""The CUDA extension's binding (ctypes; no torch, so a process that only holds the arena needs
nothing else): device allocations, their CUDA IPC handles, batched multi-stream copies.

`Native(device)` raises `NativeUnavailable` with the reason where the extension is not built
(`python -m cuda_ext.build`) or the machine has no CUDA driver; callers then use torch's own
allocations and copies (`cuda_ext.copies`), or host memory, which the arena's API hides.
"""

from __future__ import annotations

import ctypes
import threading
import weakref
from collections.abc import Sequence
from pathlib import Path

from cuda_ext.build import LIBRARY

IPC_HANDLE_BYTES = 64
_u64 = ctypes.c_uint64
_lock = threading.Lock()
_libraries: dict[Path, ctypes.CDLL] = {}


class NativeUnavailable(RuntimeError):
    """The extension cannot run here (not built, or no CUDA driver or device)."""


class CudaError(RuntimeError):
    def __init__(self, call: str, code: int, message: str) -> None:
        super().__init__(f"{call}: {message} (CUresult {code})")
        self.code = code


def _load(path: Path) -> ctypes.CDLL:
    with _lock:
        lib = _libraries.get(path)
        if lib is not None:
            return lib
        if not path.exists():
            raise NativeUnavailable(f"the CUDA extension is not built ({path}): python -m cuda_ext.build")
        lib = ctypes.CDLL(str(path))
        i, sz, p = ctypes.c_int, ctypes.c_size_t, ctypes.POINTER
        signatures: dict[str, list[type]] = {
            "tsr_init": [i],
            "tsr_alloc": [i, sz, p(_u64)],
            "tsr_free": [i, _u64],
            "tsr_ipc_export": [i, _u64, ctypes.c_char_p],
            "tsr_ipc_open": [i, ctypes.c_char_p, p(_u64)],
            "tsr_ipc_close": [i, _u64],
            "tsr_copy_batch": [i, i, p(_u64), p(_u64), p(_u64), p(i), i, p(_u64), i, _u64, _u64, p(_u64)],
            "tsr_event_wait": [i, _u64, _u64],
            "tsr_event_synchronize": [i, _u64],
            "tsr_event_destroy": [i, _u64],
            "tsr_read": [i, _u64, ctypes.c_void_p, sz],
            "tsr_copy_pageable": [i, i, p(_u64), p(_u64), p(_u64), i, _u64],
            "tsr_copy_pageable_counted": [i, i, p(_u64), p(_u64), p(_u64), i, _u64, ctypes.c_void_p],
        }
        for name, args in signatures.items():
            fn = getattr(lib, name)
            fn.argtypes = args
            fn.restype = ctypes.c_int
        lib.tsr_error.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t]
        lib.tsr_error.restype = None
        _libraries[path] = lib
        return lib


class NativeEvent:
    """An event the extension recorded; destroyed when garbage. Duck-types `torch.cuda.Event`'s
    `wait(stream)` and `synchronize()`, so loads hold either kind."""

    def __init__(self, native: Native, handle: int) -> None:
        self._native = native
        self.handle = handle
        weakref.finalize(self, native.lib.tsr_event_destroy, native.device, handle)

    def wait(self, stream: object = None) -> None:
        """Make `stream` (a torch stream, a raw handle, or None: the current torch stream) wait
        on the device for this event."""
        if stream is None or not isinstance(stream, int):
            import torch  # only a process that computes waits; it has torch

            stream = (stream or torch.cuda.current_stream()).cuda_stream  # type: ignore[attr-defined]
        self._native.check("tsr_event_wait", self._native.lib.tsr_event_wait(self._native.device, stream, self.handle))

    def synchronize(self) -> None:
        self._native.check(
            "tsr_event_synchronize", self._native.lib.tsr_event_synchronize(self._native.device, self.handle)
        )


class Native:
    """The extension, bound to CUDA device `device` (its primary context: the one torch uses)."""

    def __init__(self, device: int = 0, library: Path = LIBRARY) -> None:
        self.lib = _load(library)
        self.device = device
        code = self.lib.tsr_init(device)
        if code != 0:
            raise NativeUnavailable(f"CUDA device {device}: {self.message(code)}")

    def message(self, code: int) -> str:
        buf = ctypes.create_string_buffer(256)
        self.lib.tsr_error(code, buf, len(buf))
        return buf.value.decode(errors="replace")

    def check(self, call: str, code: int) -> None:
        if code != 0:
            raise CudaError(call, code, self.message(code))

    def alloc(self, nbytes: int) -> int:
        ptr = _u64()
        self.check("tsr_alloc", self.lib.tsr_alloc(self.device, nbytes, ctypes.byref(ptr)))
        return ptr.value

    def free(self, ptr: int) -> None:
        self.check("tsr_free", self.lib.tsr_free(self.device, ptr))

    def ipc_export(self, ptr: int) -> bytes:
        buf = ctypes.create_string_buffer(IPC_HANDLE_BYTES)
        self.check("tsr_ipc_export", self.lib.tsr_ipc_export(self.device, ptr, buf))
        return buf.raw

    def ipc_open(self, handle: bytes) -> int:
        if len(handle) != IPC_HANDLE_BYTES:
            raise ValueError(f"a CUDA IPC handle is {IPC_HANDLE_BYTES} bytes, not {len(handle)}")
        ptr = _u64()
        self.check("tsr_ipc_open", self.lib.tsr_ipc_open(self.device, handle, ctypes.byref(ptr)))
        return ptr.value

    def ipc_close(self, ptr: int) -> None:
        self.check("tsr_ipc_close", self.lib.tsr_ipc_close(self.device, ptr))

    def read(self, ptr: int, nbytes: int) -> bytes:
        buf = ctypes.create_string_buffer(nbytes)
        self.check("tsr_read", self.lib.tsr_read(self.device, ptr, buf, nbytes))
        return buf.raw

    def copy_pageable(
        self,
        spans: Sequence[tuple[int, int, int]],
        threads: int = 4,
        chunk_bytes: int = 16 << 20,
        progress: int | None = None,
    ) -> None:
        """Copy (host address, device address, bytes) spans from pageable memory, synchronously,
        through pinned staging buffers on `threads` threads and streams. `progress`: the address
        of a 64-bit word where the count of leading spans already in is stored as they land."""
        n = len(spans)
        src, dst, size = (_u64 * n)(), (_u64 * n)(), (_u64 * n)()
        for j, (s, d, b) in enumerate(spans):
            src[j], dst[j], size[j] = s, d, b
        if progress is None:
            code = self.lib.tsr_copy_pageable(self.device, n, src, dst, size, threads, chunk_bytes)
        else:
            code = self.lib.tsr_copy_pageable_counted(self.device, n, src, dst, size, threads, chunk_bytes, progress)
        self.check("tsr_copy_pageable", code)

    def copy_batch(
        self,
        spans: Sequence[tuple[int, int, int, int]],
        groups: int,
        streams: Sequence[int],
        after: int,
        chunk_bytes: int,
    ) -> list[list[NativeEvent]]:
        """Issue every span (host address, device address, bytes, group) in one call: chunked,
        round-robin on `streams`, after the work queued on stream `after`. Per group, the events
        that mark its copies done."""
        n, k = len(spans), len(streams)
        src, dst, size = (_u64 * n)(), (_u64 * n)(), (_u64 * n)()
        group = (ctypes.c_int * n)()
        for j, (s, d, b, g) in enumerate(spans):
            src[j], dst[j], size[j], group[j] = s, d, b, g
        handles = (_u64 * (groups * k))()
        code = self.lib.tsr_copy_batch(
            self.device, n, src, dst, size, group, groups, (_u64 * k)(*streams), k, after, chunk_bytes, handles
        )
        events = [[NativeEvent(self, h) for h in handles[g * k : (g + 1) * k] if h] for g in range(groups)]
        self.check("tsr_copy_batch", code)  # on failure the events made are destroyed as garbage
        return events


def unavailable(device: int = 0) -> str | None:
    """Why the extension cannot run on `device` here, or None where it can."""
    try:
        Native(device)
    except NativeUnavailable as e:
        return str(e)
    return None

"""The arena's memory, shareable between processes: one allocation a node's arena owner makes
and each engine worker maps (Tangram §4: one pool per device that outlives the instances).

On CUDA the owner allocates with the extension (`cuda_ext.native`: cuMemAlloc) and hands out its
CUDA IPC handle; a worker opens the handle and sees the same device memory. On the host the
memory is a memfd the owner keeps open, mapped by each worker through the owner's
/proc/<pid>/fd entry: the same API, so the engine runs one arena per node on either. This module
imports no torch (the owner needs none); `view` makes a torch tensor of a mapping for a worker.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from cuda_ext.native import Native

if TYPE_CHECKING:
    import torch

_libc = ctypes.CDLL(None, use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
_PUNCH_HOLE, _KEEP_SIZE = 0x02, 0x01
HOST_PIECE = 8 << 20


@dataclass(frozen=True)
class ArenaHandle:
    """What a worker needs to map an arena another process owns."""

    device: str
    """"cuda:N" or "cpu"."""
    nbytes: int
    ipc: bytes = b""
    """The CUDA IPC handle of the allocation (CUDA)."""
    path: str = ""
    """The owner's memfd, as /proc/<pid>/fd/<n> (host)."""

    @property
    def cuda(self) -> bool:
        return self.device.startswith("cuda")

    @property
    def index(self) -> int:
        return int(self.device.partition(":")[2] or 0)


class SharedMemory:
    """The owner's side: `nbytes` on `device`, kept until `close()` (or the owner's exit)."""

    def __init__(self, nbytes: int, device: str = "cpu") -> None:
        self.nbytes = nbytes
        self.device = device
        self._native: Native | None = None
        self._closer: weakref.finalize[..., Any]
        self.address = 0
        self._fd = -1
        self._map: mmap.mmap | None = None
        """The owner's own mapping of a host arena, made when it first writes to it."""
        if device.startswith("cuda"):
            handle = ArenaHandle(device, nbytes)
            self._native = Native(handle.index)
            self.address = self._native.alloc(nbytes)
            self.handle = ArenaHandle(device, nbytes, ipc=self._native.ipc_export(self.address))
            self._closer = weakref.finalize(self, self._native.free, self.address)
        else:
            # Pages are taken as they are first written: an arena's size is a bound, not a cost.
            self._fd = os.memfd_create("tessera-arena", os.MFD_CLOEXEC)
            os.ftruncate(self._fd, nbytes)
            self.handle = ArenaHandle("cpu", nbytes, path=f"/proc/{os.getpid()}/fd/{self._fd}")
            self._closer = weakref.finalize(self, os.close, self._fd)

    def close(self) -> None:
        """Free the memory (on CUDA) or drop the owner's reference (host: the pages go with the
        last worker's mapping)."""
        if self._map is not None:
            self._map.close()
            self._map = None
        self._closer()

    @property
    def counts_progress(self) -> bool:
        """Whether `copy_from_file` counts its spans as they land (`progress`): on CUDA, where
        the extension copies them all in one call."""
        return self._native is not None

    def copy_from_file(
        self, path: Path, spans: Sequence[tuple[int, int, int]], threads: int = 0, progress: int | None = None
    ) -> None:
        """Copy (file offset, arena offset, bytes) spans of `path` into the arena, synchronously:
        on CUDA through the extension's pinned staging on `threads` threads (default: up to 8;
        the file's pages are pageable), storing at address `progress` how many leading spans
        are in as they land; on the host with memcpy."""
        with open(path, "rb") as f:
            source = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            if self._native is not None:
                base = np.frombuffer(source, dtype=np.uint8)
                try:
                    start = base.ctypes.data
                    threads = threads or min(8, os.cpu_count() or 1)
                    self._native.copy_pageable(
                        [(start + s, self.address + d, n) for s, d, n in spans], threads, progress=progress
                    )
                finally:
                    del base  # the mapping closes only once nothing points into it
            else:
                if self._map is None:
                    self._map = mmap.mmap(self._fd, self.nbytes, mmap.MAP_SHARED)
                view = memoryview(source)
                for s, d, n in spans:
                    # In pieces: a copy holds the interpreter's lock, which the caller's other
                    # threads (the engine's event loop) get back between pieces.
                    for at in range(0, n, HOST_PIECE):
                        k = min(HOST_PIECE, n - at)
                        self._map[d + at : d + at + k] = view[s + at : s + at + k]
                view.release()
        finally:
            source.close()

    def discard(self, offset: int, nbytes: int) -> None:
        """Give a range's pages back to the host (they read as zeros after): what an evicted
        range of a host arena costs otherwise stays taken. Device memory is the arena's for
        good; on CUDA this does nothing."""
        if self._fd < 0 or nbytes <= 0:
            return
        if _libc.fallocate(self._fd, _PUNCH_HOLE | _KEEP_SIZE, ctypes.c_long(offset), ctypes.c_long(nbytes)) != 0:
            raise OSError(ctypes.get_errno(), f"fallocate(PUNCH_HOLE) of {nbytes} bytes at {offset}")

    def view(self) -> torch.Tensor:
        """The owner's own mapping, as a uint8 tensor (CUDA IPC cannot open a handle in the
        process that made it)."""
        if self._native is not None:
            return _cuda_tensor(_CudaArray(self.address, self.nbytes, keep=self), self.handle.index)
        return _host_tensor(self.handle.path, self.nbytes)


class _CudaArray:
    """A device range as `__cuda_array_interface__`, which torch maps without a copy; the tensor
    keeps this object, so `on_free` runs once no tensor uses the range."""

    def __init__(self, address: int, nbytes: int, keep: Any = None) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (address, False),
            "version": 3,
            "strides": None,
        }
        self.keep = keep


def _cuda_tensor(array: _CudaArray, index: int) -> torch.Tensor:
    import torch

    return torch.as_tensor(array, device=torch.device("cuda", index))


def _host_tensor(path: str, nbytes: int) -> torch.Tensor:
    import torch

    with open(path, "r+b") as f:
        mapped = mmap.mmap(f.fileno(), nbytes, mmap.MAP_SHARED)
    # The tensor keeps the mapping alive (frombuffer holds the buffer); unmapped when both go.
    return torch.frombuffer(mapped, dtype=torch.uint8, count=nbytes)


def attach(handle: ArenaHandle) -> torch.Tensor:
    """A worker's mapping of an arena another process owns, as a uint8 tensor: the same memory
    (on CUDA by IPC, the handle closed once no tensor uses it)."""
    if handle.cuda:
        native = Native(handle.index)
        address = native.ipc_open(handle.ipc)
        opened = _CudaArray(address, handle.nbytes)
        weakref.finalize(opened, native.ipc_close, address)
        return _cuda_tensor(opened, handle.index)
    return _host_tensor(handle.path, handle.nbytes)

"""Tessera's GPU memory: a tensor arena with content-hash reuse and batched host-to-device copies.

Runs on CUDA where torch sees a device and on host memory elsewhere, with the same API; see
README.md. Names are imported on first use: the engine's main process owns the node's arena
(`cuda_ext.ledger`, `cuda_ext.memory`) without importing torch, which the arena's views need.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from cuda_ext.allocator import ArenaFull, Block, RangeAllocator
    from cuda_ext.arena import Loaded, Resident, TensorArena, default_device
    from cuda_ext.copies import CopyEngine, Span, Transfer
    from cuda_ext.digest import content_digest, content_digests
    from cuda_ext.host import HostImage, TensorSpec
    from cuda_ext.ledger import ArenaLedger, Placement
    from cuda_ext.memory import ArenaHandle, SharedMemory

_HOMES = {
    "ArenaFull": "allocator",
    "Block": "allocator",
    "RangeAllocator": "allocator",
    "Loaded": "arena",
    "Resident": "arena",
    "TensorArena": "arena",
    "default_device": "arena",
    "CopyEngine": "copies",
    "Span": "copies",
    "Transfer": "copies",
    "content_digest": "digest",
    "content_digests": "digest",
    "HostImage": "host",
    "TensorSpec": "host",
    "ArenaLedger": "ledger",
    "Placement": "ledger",
    "ArenaHandle": "memory",
    "SharedMemory": "memory",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'cuda_ext' has no attribute {name!r}")
    return getattr(importlib.import_module(f"cuda_ext.{home}"), name)


__all__ = [
    "ArenaFull",
    "ArenaHandle",
    "ArenaLedger",
    "Block",
    "CopyEngine",
    "HostImage",
    "Loaded",
    "Placement",
    "RangeAllocator",
    "Resident",
    "SharedMemory",
    "Span",
    "TensorArena",
    "TensorSpec",
    "Transfer",
    "content_digest",
    "content_digests",
    "default_device",
]

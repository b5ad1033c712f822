"""Tessera's GPU memory: a tensor arena with content-hash reuse and batched host-to-device copies.

Runs on CUDA where torch sees a device and on host memory elsewhere, with the same API; see
README.md.
"""

from cuda_ext.allocator import ArenaFull, Block, RangeAllocator
from cuda_ext.arena import Loaded, Resident, TensorArena, default_device
from cuda_ext.copies import CopyEngine, Span, Transfer
from cuda_ext.digest import content_digest, content_digests
from cuda_ext.host import HostImage, TensorSpec

__all__ = [
    "ArenaFull",
    "Block",
    "CopyEngine",
    "HostImage",
    "Loaded",
    "RangeAllocator",
    "Resident",
    "Span",
    "TensorArena",
    "TensorSpec",
    "Transfer",
    "content_digest",
    "content_digests",
    "default_device",
]

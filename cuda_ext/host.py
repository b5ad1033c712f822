"""The host cache's image of a model: its tensors packed in one (pinned) host buffer.

Packed in access order at the arena's alignment, so that a load into a fresh range of the arena
coalesces into a few large copies; pinned where CUDA is present, so those copies are DMA from
the buffer itself with no staging copy (TIDAL §4 keeps templates' weights in host memory the
same way). Without CUDA the buffer is ordinary memory.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import torch

from cuda_ext.allocator import align_up
from cuda_ext.copies import byte_view
from cuda_ext.digest import content_digests

REGISTER_ABOVE = 1 << 30


@dataclass(frozen=True)
class TensorSpec:
    """What the arena needs to know of a tensor: its name in the model, content, type, shape."""

    name: str
    digest: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for d in self.shape:
            n *= d
        return n


class HostImage:
    """Tensors in one host buffer, each at an aligned offset; `specs` in the order packed."""

    def __init__(self, specs: Sequence[TensorSpec], pin: bool, alignment: int = 256) -> None:
        self.specs = list(specs)
        self.offsets: dict[str, int] = {}
        at = 0
        for spec in self.specs:
            self.offsets[spec.name] = at
            at += align_up(max(spec.nbytes, 1), alignment)
        self.nbytes = at
        self.alignment = alignment
        self.pinned = pin
        self.buffer = self._pinned(at) if pin else torch.empty(at, dtype=torch.uint8)
        self._by_name = {s.name: s for s in self.specs}

    def bytes_of(self, name: str) -> torch.Tensor:
        spec = self._by_name[name]
        at = self.offsets[name]
        return self.buffer[at : at + spec.nbytes]

    def _pinned(self, nbytes: int) -> torch.Tensor:
        """Page-locked memory of exactly `nbytes`. torch's pinned allocator rounds a block up to
        a power of two (an 8B model's 16 GB would pin 32 GB), so a large image registers plain
        memory with the driver instead, and unregisters it when the image goes."""
        if nbytes < REGISTER_ABOVE:
            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        buffer = torch.empty(nbytes, dtype=torch.uint8)
        cudart = torch.cuda.cudart()
        if int(cudart.cudaHostRegister(buffer.data_ptr(), nbytes, 0)) != 0:
            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        weakref.finalize(self, cudart.cudaHostUnregister, buffer.data_ptr())
        return buffer

    def slot(self, name: str) -> torch.Tensor:
        """The tensor's bytes and the padding after it up to the next tensor: copying whole slots
        lets tensors packed back to back coalesce into one copy."""
        at = self.offsets[name]
        return self.buffer[at : at + align_up(max(self._by_name[name].nbytes, 1), self.alignment)]

    def tensor(self, name: str) -> torch.Tensor:
        spec = self._by_name[name]
        return self.bytes_of(name).view(spec.dtype).view(spec.shape)

    def digest_contents(self, threads: int = 8) -> None:
        """Set every spec's digest from the bytes now in the buffer (for an image filled in place)."""
        digests = content_digests({s.name: self.bytes_of(s.name) for s in self.specs}, threads)
        self.specs = [replace(s, digest=digests[s.name]) for s in self.specs]
        self._by_name = {s.name: s for s in self.specs}

    @classmethod
    def of(
        cls,
        tensors: Mapping[str, torch.Tensor],
        digests: Mapping[str, str] | None = None,
        pin: bool | None = None,
        alignment: int = 256,
    ) -> HostImage:
        """Pack `tensors` (in their mapping order: give it access order) into a new image; pinned
        by default where CUDA is present. Digests are computed when not given."""
        if digests is None:
            digests = content_digests(tensors)
        specs = [TensorSpec(n, digests[n], t.dtype, tuple(t.shape)) for n, t in tensors.items()]
        image = cls(specs, torch.cuda.is_available() if pin is None else pin, alignment)
        for name, t in tensors.items():
            image.bytes_of(name).copy_(byte_view(t.detach().contiguous()))
        return image

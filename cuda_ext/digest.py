"""Content hashes of tensors: the key of Tangram's reuse (§3.1), computed once at registration.

Two tensors with the same bytes share one resident range whatever their names, so fine-tunes
of one base find the base's tensors resident. sha256 over the bytes alone: a view gives them
their dtype and shape. hashlib releases the GIL on large buffers, so a thread pool hashes a
model on every core.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor

import torch

from cuda_ext.copies import byte_view


def content_digest(t: torch.Tensor) -> str:
    """sha256 of a tensor's bytes (copied to the host first when it lives on a device)."""
    data = byte_view(t.detach().contiguous()).cpu()
    return hashlib.sha256(data.numpy().data).hexdigest()


def content_digests(tensors: Mapping[str, torch.Tensor], threads: int = 8) -> dict[str, str]:
    """name → digest for every tensor, hashed in parallel."""
    names: Iterable[str] = list(tensors)
    with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
        return dict(zip(names, pool.map(lambda n: content_digest(tensors[n]), names), strict=True))

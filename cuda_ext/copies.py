"""Batched copies of many byte spans, host to device on several CUDA streams (FaaScale §5).

A weight load is hundreds of tensors. Copied one `copy_` at a time, each small one pays a
launch and the large ones serialize on one stream; here spans whose source and destination are
both contiguous with the previous span are merged first (a model packed in access order in the
host cache and in the arena merges into a few transfers), the merged spans are cut into chunks,
and the chunks go round-robin onto `streams` CUDA streams. Groups (TIDAL §5: the layers in
access order) each get events, so that compute can wait on the GPU for exactly the group it
needs while later groups are still copying. Without CUDA the same calls copy synchronously.

Where the CUDA extension is built (`cuda_ext.build`), one call into it issues every chunk of a
load with no interpreter between copies (`cuda_ext.native`); elsewhere torch's `copy_` does, one
at a time, to the same effect.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from cuda_ext.native import Native, NativeUnavailable

# Large enough that a chunk runs at the link's bandwidth (a copy's fixed cost is ≈ 10 µs, and
# 16 MiB take ≈ 300 µs at 50 GB/s), small enough that several streams share a big tensor.
CHUNK_BYTES = 16 << 20


class Event(Protocol):
    """A copy's completion: `torch.cuda.Event`, or the extension's `NativeEvent`."""

    def wait(self, stream: torch.cuda.Stream | None = None) -> None: ...

    def synchronize(self) -> None: ...


@dataclass(frozen=True)
class Span:
    """One copy: `src` into `dst`, both one-dimensional uint8 views of equal length."""

    src: torch.Tensor
    dst: torch.Tensor


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as a one-dimensional uint8 view of the same memory."""
    if not t.is_contiguous():
        raise ValueError("a copy needs contiguous tensors")
    return t.reshape(-1).view(torch.uint8) if t.numel() else t.new_empty(0, dtype=torch.uint8)


def _follows(prev: torch.Tensor, cur: torch.Tensor) -> bool:
    return (
        prev.device == cur.device
        and prev.untyped_storage().data_ptr() == cur.untyped_storage().data_ptr()
        and prev.data_ptr() + prev.numel() == cur.data_ptr()
    )


def _widen(prev: torch.Tensor, extra: int) -> torch.Tensor:
    return prev.as_strided((prev.numel() + extra,), (1,), prev.storage_offset())


def coalesce(spans: Sequence[Span]) -> list[Span]:
    """Merge each span into the previous one where both its ends continue the previous one's."""
    merged: list[Span] = []
    for span in spans:
        if span.src.numel() != span.dst.numel():
            raise ValueError(f"span of {span.src.numel()} bytes into {span.dst.numel()}")
        if span.src.numel() == 0:
            continue
        if merged and _follows(merged[-1].src, span.src) and _follows(merged[-1].dst, span.dst):
            last = merged[-1]
            merged[-1] = Span(_widen(last.src, span.src.numel()), _widen(last.dst, span.dst.numel()))
        else:
            merged.append(span)
    return merged


def _chunks(span: Span, chunk_bytes: int) -> list[Span]:
    n = span.src.numel()
    return [Span(span.src[i : i + chunk_bytes], span.dst[i : i + chunk_bytes]) for i in range(0, n, chunk_bytes)]


class Transfer:
    """Copies under way: per group, the events that mark it copied (none without CUDA)."""

    def __init__(self, events: list[list[Event]], nbytes: int, transfers: int) -> None:
        self.events = events
        self.nbytes = nbytes
        """Bytes copied."""
        self.transfers = transfers
        """Copies issued after coalescing and chunking."""

    def wait(self, group: int) -> None:
        """Make the current stream wait (on the GPU, the host goes on) until `group` is copied."""
        for event in self.events[group]:
            event.wait(torch.cuda.current_stream())

    def synchronize(self) -> None:
        """Block the host until every group is copied."""
        for group in self.events:
            for event in group:
                event.synchronize()


class CopyEngine:
    """Issues batched copies for one device; keeps its streams for the life of the process."""

    def __init__(
        self, device: torch.device, streams: int = 4, chunk_bytes: int = CHUNK_BYTES, native: bool | None = None
    ) -> None:
        """`native`: issue the copies through the CUDA extension (True: required; None: where
        it is built and a driver is present; False: torch's copies)."""
        self.device = device
        self.chunk_bytes = chunk_bytes
        self.cuda = device.type == "cuda"
        self._streams = [torch.cuda.Stream(device=device) for _ in range(streams)] if self.cuda else []
        self.native: Native | None = None
        if self.cuda and native is not False:
            try:
                self.native = Native(device.index if device.index is not None else torch.cuda.current_device())
            except NativeUnavailable:
                if native:
                    raise

    def copy(self, groups: Sequence[Sequence[Span]]) -> Transfer:
        """Copy every group's spans, group after group; on CUDA asynchronously (sources in pinned
        host memory copy without staging), else right away."""
        if self.native is not None:
            return self._copy_native(self.native, groups)
        events: list[list[Event]] = []
        nbytes = transfers = 0
        if self.cuda:
            # The copies must not start before whatever the current stream was doing with the
            # destination (a range freed and reallocated) is done.
            ready = torch.cuda.current_stream(self.device).record_event()
            for stream in self._streams:
                stream.wait_event(ready)
        turn = 0
        for group in groups:
            used: set[int] = set()
            for span in coalesce(group):
                nbytes += span.src.numel()
                for chunk in _chunks(span, self.chunk_bytes):
                    transfers += 1
                    if self.cuda:
                        with torch.cuda.stream(self._streams[turn]):
                            chunk.dst.copy_(chunk.src, non_blocking=True)
                        used.add(turn)
                        turn = (turn + 1) % len(self._streams)
                    else:
                        chunk.dst.copy_(chunk.src)
            events.append([self._streams[i].record_event() for i in sorted(used)])
        return Transfer(events, nbytes, transfers)

    def _copy_native(self, native: Native, groups: Sequence[Sequence[Span]]) -> Transfer:
        spans: list[tuple[int, int, int, int]] = []
        nbytes = transfers = 0
        for g, group in enumerate(groups):
            for span in coalesce(group):
                n = span.src.numel()
                spans.append((span.src.data_ptr(), span.dst.data_ptr(), n, g))
                nbytes += n
                transfers += -(-n // self.chunk_bytes)
        after = torch.cuda.current_stream(self.device).cuda_stream
        streams = [s.cuda_stream for s in self._streams]
        events: list[list[Event]] = [
            list(group) for group in native.copy_batch(spans, len(groups), streams, after, self.chunk_bytes)
        ]
        return Transfer(events, nbytes, transfers)

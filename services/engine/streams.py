"""The text of every request on the engine core: tokens held per stream interval, then all
due requests detokenized together.

vLLM detokenizes a crowd's tokens off the engine's loop, in its frontend; here the worker's
loop does it between steps, so what matters is the number of detokenizer runs: one per
distinct window length per flush (`Detokenizer.decode_many`) instead of two per request.
Measured at 32 streams: decoding each request's piece alone took a fifth of the loop.

Pure bookkeeping around a `decode_many` callable and a clock, so tests drive it with a toy
vocabulary and a fake clock.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from services.engine.detokenize import IncrementalDetokenizer
from services.engine.worker_wire import Chunk
from shared.messages import TokenLogprob

DecodeMany = Callable[[Sequence[Sequence[int]]], list[str]]

CROWD_CHUNKS_PER_S = 100.0
"""Most chunks a worker's streams send per second together: with more streams than this many
times their interval allows, each stream's interval stretches to `streams / rate`.

Every chunk is a pipe read and a NATS publish in the engine, a NATS delivery and an SSE event
in the gateway, and a read in the client, on the cores that also run the model; at 32 streams
and 0.1 s that was ≈ 300 chunks/s and a tenth of the node's CPU. A client of a crowd then
gets its text in pieces of a few tokens (at 32 streams every 0.32 s), which the total rate,
TTFT and the text itself do not notice; a lone stream keeps its interval."""


@dataclass
class _Stream:
    detok: IncrementalDetokenizer
    interval_s: float
    pending: int = 0
    """Tokens written since the last piece."""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    """Those tokens' logprobs, when the request asked for them."""
    last: float | None = None
    """When its last piece went out (None before the first: that one goes at once)."""
    ended: bool = False


def _undecoded(ids: Sequence[int]) -> str:  # IncrementalDetokenizer's own decode is never used
    raise AssertionError("CoreStreams decodes in batches")


class _Sink:
    """One request's end of `CoreStreams` (what `EngineCore` writes its tokens to)."""

    def __init__(self, streams: CoreStreams, request_id: str) -> None:
        self._streams = streams
        self._id = request_id

    def write(self, tokens: Sequence[int], logprobs: Sequence[float] = ()) -> None:
        self._streams.write(self._id, tokens, logprobs)

    def end(self) -> None:
        self._streams.end(self._id)


@dataclass
class CoreStreams:
    decode_many: DecodeMany
    clock: Callable[[], float] = time.monotonic
    chunks_per_s: float = CROWD_CHUNKS_PER_S
    _streams: dict[str, _Stream] = field(default_factory=dict)

    def open(self, request_id: str, interval_s: float) -> _Sink:
        self._streams[request_id] = _Stream(IncrementalDetokenizer(_undecoded), interval_s)
        return _Sink(self, request_id)

    def write(self, request_id: str, tokens: Sequence[int], logprobs: Sequence[float] = ()) -> None:
        stream = self._streams[request_id]
        stream.detok.extend(tokens)
        stream.pending += len(tokens)
        stream.logprobs += [
            TokenLogprob(token=int(t), logprob=float(lp)) for t, lp in zip(tokens, logprobs, strict=False)
        ]  # none when not asked for

    def end(self, request_id: str) -> None:
        self._streams[request_id].ended = True

    def __len__(self) -> int:
        return len(self._streams)

    def flush(self) -> list[Chunk]:
        """The pieces due now: a stream's first text at once, then at most one piece per
        interval (stretched for a crowd: `CROWD_CHUNKS_PER_S`), and the rest of every stream that ended (which is then forgotten). A piece
        that ends mid-character waits for its next token."""
        now = self.clock()
        crowd_s = len(self._streams) / self.chunks_per_s if self.chunks_per_s > 0 else 0.0
        due = [
            (rid, s)
            for rid, s in self._streams.items()
            if s.ended or (s.pending and (s.last is None or now - s.last >= max(s.interval_s, crowd_s)))
        ]
        if not due:
            return []
        # An ended stream with nothing pending has emitted all its text: nothing to decode.
        windows = [w for _, s in due for w in (s.detok.windows() if s.pending else ([], []))]
        texts = self.decode_many(windows)
        pieces: list[Chunk] = []
        for i, (rid, s) in enumerate(due):
            text = s.detok.settle(texts[2 * i], texts[2 * i + 1], final=s.ended)
            if text or (s.ended and s.pending):
                pieces.append(Chunk(rid, text, s.pending, tuple(s.logprobs)))
                s.pending = 0
                s.logprobs.clear()
                s.last = now
            if s.ended:
                del self._streams[rid]
        return pieces

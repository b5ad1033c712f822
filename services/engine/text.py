"""Every running request's text in a worker: tokens in, `Chunk`s out. The one place tokens
become streamed text, whatever engine made them (`worker_loop.py` feeds it each step's tokens).

Three stages per request: incremental detokenization (a token's text once it is whole UTF-8,
`detokenize.py`), stop strings (the stop itself and anything after it never leave,
`stops.py`), and coalescing into one chunk per stream interval, the first at once (each chunk
wakes the engine, NATS, the gateway and the client: `EngineSettings.stream_interval_s`,
vLLM's `stream_interval`), the interval stretched for a crowd (`CROWD_CHUNKS_PER_S`).

vLLM detokenizes a crowd's tokens off the engine's loop, in its frontend; here the worker's
loop does it between steps, so what matters is the number of detokenizer runs: every request
due is decoded in one `decode_many` call per flush (one detokenizer run per distinct window
length) instead of two runs per request. Measured at 32 streams on the OpenVINO core:
decoding each request's piece alone took a fifth of the loop. A request with stop strings is
decoded at every flush, one token a round, so that it ends exactly at its stop (and its
computation with it); one without is decoded only when a chunk of it is due (detokenizing
each token cost ≈ 8 % of decode time on the start tier).

Pure bookkeeping around a `decode_many` callable and a clock, so tests drive it with a toy
vocabulary and a fake clock; it imports no runtime.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from services.engine.detokenize import IncrementalDetokenizer
from services.engine.stops import StopMatcher
from services.engine.worker_wire import Chunk
from shared.messages import TokenLogprob

DecodeMany = Callable[[Sequence[Sequence[int]]], list[str]]
"""Each token sequence's text, in as few detokenizer runs as the library allows."""

CROWD_CHUNKS_PER_S = 100.0
"""Most chunks a worker's streams send per second together: with more streams than this many
times their interval allows, each stream's interval stretches to `streams / rate`.

Every chunk is a pipe read and a NATS publish in the engine, a NATS delivery and an SSE event
in the gateway, and a read in the client, on the cores that also run the model; at 32 streams
and 0.1 s that was ≈ 300 chunks/s and a tenth of the node's CPU. A client of a crowd then
gets its text in pieces of a few tokens (at 32 streams every 0.32 s), which the total rate,
TTFT and the text itself do not notice; a lone stream keeps its interval."""


def batch_decoder(tokenizer: Any) -> DecodeMany:
    """`decode_many` over a Hugging Face tokenizer (`batch_decode`: one call for the lot),
    with the text a client of `tokenizer.decode(ids, skip_special_tokens=True)` gets."""

    def decode_many(seqs: Sequence[Sequence[int]]) -> list[str]:
        if not seqs:
            return []
        texts = tokenizer.batch_decode(
            [list(s) for s in seqs], skip_special_tokens=True, clean_up_tokenization_spaces=False
        )
        return [str(t) for t in texts]

    return decode_many


@dataclass
class _Stream:
    detok: IncrementalDetokenizer
    stops: StopMatcher
    interval_s: float
    undecoded: list[int] = field(default_factory=list)
    """Tokens written, not yet through the detokenizer."""
    text: list[str] = field(default_factory=list)
    """Decoded text past its stop strings, not yet sent."""
    decoded: int = 0
    """Tokens behind `text` (and any the detokenizer holds mid-character), not yet sent."""
    logprobs: list[TokenLogprob | None] = field(default_factory=list)
    """One per token not yet sent (decoded first, then undecoded); None where not asked for."""
    taken: int = 0
    """Tokens it took through the detokenizer in all (up to its stop, once reached)."""
    last: float | None = None
    """When its last chunk went out (None before the first: that one goes at once)."""
    ended: bool = False


@dataclass(frozen=True)
class Flushed:
    chunks: list[Chunk]
    stopped: dict[str, int]
    """Requests that reached a stop string, each with the tokens it took up to it: they end
    ("stop") and their batch stops computing them. Their streams are gone."""


def _never(ids: Sequence[int]) -> str:  # IncrementalDetokenizer's own decode is never used
    raise AssertionError("StreamText decodes in batches")


@dataclass
class StreamText:
    decode_many: DecodeMany
    clock: Callable[[], float] = time.monotonic
    chunks_per_s: float = CROWD_CHUNKS_PER_S
    _streams: dict[str, _Stream] = field(default_factory=dict, init=False)

    def open(self, request_id: str, interval_s: float, stops: Sequence[str] = ()) -> None:
        self._streams[request_id] = _Stream(IncrementalDetokenizer(_never), StopMatcher(stops), interval_s)

    def write(self, request_id: str, tokens: Sequence[tuple[int, TokenLogprob | None]]) -> None:
        """New tokens of a request, each with its logprob where it asked for them."""
        stream = self._streams[request_id]
        stream.undecoded += [int(t) for t, _ in tokens]
        stream.logprobs += [lp for _, lp in tokens]

    def end(self, request_id: str) -> None:
        """No more tokens: the next flush sends the rest and forgets the stream."""
        self._streams[request_id].ended = True

    def drop(self, request_id: str) -> None:
        """Forget the request's stream and what it held (cancelled)."""
        self._streams.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._streams)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._streams

    def flush(self) -> Flushed:
        """The chunks due now: a stream's first text at once, then at most one chunk per
        interval (stretched for a crowd), the rest of every stream that ended (then forgotten),
        and the text up to a stop string reached. A chunk that would end mid-character, or in
        what may begin a stop string, waits for the next token."""
        now = self.clock()
        crowd_s = len(self._streams) / self.chunks_per_s if self.chunks_per_s > 0 else 0.0
        due = {
            rid
            for rid, s in self._streams.items()
            if s.ended
            or ((s.decoded or s.undecoded) and (s.last is None or now - s.last >= max(s.interval_s, crowd_s)))
        }
        self._decode(
            [
                s
                for rid, s in self._streams.items()
                if (rid in due or s.stops.stops) and (s.undecoded or (s.ended and s.detok.holding))
            ]
        )
        chunks: list[Chunk] = []
        stopped: dict[str, int] = {}
        for rid, s in list(self._streams.items()):
            if s.stops.stopped:
                stopped[rid] = s.taken
            elif rid not in due:
                continue
            final = s.ended or s.stops.stopped
            if s.ended:  # what was held as a possible stop is plain text after all
                s.text.append(s.stops.flush())
            text = "".join(s.text)
            if text or (final and s.decoded):
                logprobs = tuple(lp for lp in s.logprobs[: s.decoded] if lp is not None)
                chunks.append(Chunk(rid, text, s.decoded, logprobs))
                del s.logprobs[: s.decoded]
                s.text.clear()
                s.decoded = 0
                s.last = now
            if final:
                del self._streams[rid]
        return Flushed(chunks, stopped)

    def _decode(self, work: list[_Stream]) -> None:
        """Take `work`'s undecoded tokens through the detokenizer and the stop matcher: every
        stream's in one `decode_many` call a round; a stream with stop strings one token a
        round (it must stop at the token that completes one), the others all at once."""
        while work:
            windows: list[list[int]] = []
            for s in work:
                n = 1 if s.stops.stops else len(s.undecoded)
                s.detok.extend(s.undecoded[:n])
                del s.undecoded[:n]
                s.decoded += n
                s.taken += n
                windows += s.detok.windows()
            texts = self.decode_many(windows)
            going: list[_Stream] = []
            for i, s in enumerate(work):
                final = s.ended and not s.undecoded
                s.text.append(s.stops.feed(s.detok.settle(texts[2 * i], texts[2 * i + 1], final=final)))
                if s.stops.stopped:  # what came after the stop is dropped with its logprobs
                    s.undecoded.clear()
                    del s.logprobs[s.decoded :]
                elif s.undecoded:
                    going.append(s)
            work = going

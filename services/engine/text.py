"""Every running request's text in a worker: tokens in, `Chunk`s out, whatever engine made them.

Per request: incremental detokenization, stop strings (the stop and anything after it never
leave), and one chunk per stream interval, the first at once (each chunk wakes the engine,
NATS, the gateway and the client: vLLM's `stream_interval`), stretched for a crowd.

Every request due is decoded in one `decode_many` call per flush: at 32 streams on the OpenVINO
core, decoding each request alone took a fifth of the loop. A request with stop strings is
decoded one token a round, so that it ends exactly at its stop; one without only when a chunk
is due (detokenizing each token cost ≈ 8 % of decode time on the start tier).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from services.engine.worker_wire import Chunk
from shared.messages import TokenLogprob

DecodeMany = Callable[[Sequence[Sequence[int]]], list[str]]

CROWD_CHUNKS_PER_S = 100.0
"""Most chunks a worker's streams send per second together: each stream's interval stretches to
`streams / rate` past that. Every chunk costs a pipe read, a NATS publish and delivery and an
SSE event on the model's cores: at 32 streams and 0.1 s that was ≈ 300 chunks/s and a tenth of
the node's CPU. A crowd's client then gets a few tokens a piece; a lone stream keeps its
interval."""


def batch_decoder(tokenizer: Any) -> DecodeMany:
    """`decode_many` over a Hugging Face tokenizer: `decode(ids, skip_special_tokens=True)`'s text."""

    def decode_many(seqs: Sequence[Sequence[int]]) -> list[str]:
        if not seqs:
            return []
        texts = tokenizer.batch_decode(
            [list(s) for s in seqs], skip_special_tokens=True, clean_up_tokenization_spaces=False
        )
        return [str(t) for t in texts]

    return decode_many


class IncrementalDetokenizer:
    """Text of each new token as soon as it is whole (vLLM's incremental detokenization): a
    short window of recent tokens is decoded with and without the newest (`windows`, many
    requests' in one run), the difference emitted once it no longer ends mid-character
    (`settle`). OpenVINO GenAI's TextStreamer holds the first text for three tokens: ≈ 45 ms
    of TTFT here."""

    def __init__(self) -> None:
        self._ids: list[int] = []
        self._prefix = 0  # window start: text before it is final
        self._read = 0  # tokens whose text has been emitted

    @property
    def holding(self) -> bool:
        return self._read < len(self._ids)

    def extend(self, tokens: Sequence[int]) -> None:
        self._ids.extend(tokens)

    def windows(self) -> tuple[list[int], list[int]]:
        return self._ids[self._prefix : self._read], self._ids[self._prefix :]

    def settle(self, before: str, after: str, final: bool = False) -> str:
        """The new text ("" while it ends mid-character; `final`: whatever there is)."""
        if final:
            self._read = len(self._ids)
            return after[len(before) :]
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self._ids)
            return after[len(before) :]
        return ""


class StopMatcher:
    """OpenAI's stop strings: neither the stop nor anything after it is sent; a suffix that may
    begin a stop is held until the next piece decides it."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(s for s in stops if s)
        self._held = ""
        self.stopped = False

    def feed(self, text: str) -> str:
        """The part of `text` that can be sent now."""
        if self.stopped or not self.stops:
            return "" if self.stopped else text
        buf = self._held + text
        hits = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped, self._held = True, ""
            return buf[: min(hits)]
        keep = max((n for s in self.stops for n in range(1, len(s)) if buf.endswith(s[:n])), default=0)
        self._held = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep]

    def flush(self) -> str:
        """At the end: whatever was held is plain text after all."""
        held, self._held = self._held, ""
        return "" if self.stopped else held


@dataclass
class _Stream:
    interval_s: float
    stops: StopMatcher
    detok: IncrementalDetokenizer = field(default_factory=IncrementalDetokenizer)
    undecoded: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    """Decoded text past its stop strings, not yet sent."""
    decoded: int = 0
    """Tokens behind `text` (and any the detokenizer holds mid-character), not yet sent."""
    logprobs: list[TokenLogprob | None] = field(default_factory=list)
    """One per token not yet sent."""
    taken: int = 0
    """Tokens taken through the detokenizer in all (up to its stop, once reached)."""
    last: float | None = None
    """When its last chunk went out (None: the first goes at once)."""
    ended: bool = False


class Flushed(NamedTuple):
    chunks: list[Chunk]
    stopped: dict[str, int]
    """Requests that reached a stop string, with the tokens taken up to it (streams gone)."""


@dataclass
class StreamText:
    decode_many: DecodeMany
    clock: Callable[[], float] = time.monotonic
    chunks_per_s: float = CROWD_CHUNKS_PER_S
    _streams: dict[str, _Stream] = field(default_factory=dict, init=False)

    def open(self, request_id: str, interval_s: float, stops: Sequence[str] = ()) -> None:
        self._streams[request_id] = _Stream(interval_s, StopMatcher(stops))

    def write(self, request_id: str, tokens: Sequence[tuple[int, TokenLogprob | None]]) -> None:
        stream = self._streams[request_id]
        stream.undecoded += [int(t) for t, _ in tokens]
        stream.logprobs += [lp for _, lp in tokens]

    def end(self, request_id: str) -> None:
        self._streams[request_id].ended = True  # the next flush sends the rest and forgets it

    def drop(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._streams)

    def flush(self) -> Flushed:
        """The chunks due: a stream's first text at once, then one per interval, the rest of a
        stream that ended, the text up to a stop. Text mid-character or maybe a stop waits."""
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
            if s.ended:
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
        """`work`'s undecoded tokens through the detokenizer and the stop matcher, in one
        `decode_many` a round: a stream with stop strings a token a round, the others at once."""
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
                if s.stops.stopped:  # what came after the stop goes, with its logprobs
                    s.undecoded.clear()
                    del s.logprobs[s.decoded :]
                elif s.undecoded:
                    going.append(s)
            work = going

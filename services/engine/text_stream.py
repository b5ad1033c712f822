"""One request's text: tokens in, the pieces its stream sends out. Both engines' per-request
paths use it: the OpenVINO worker's stateful tier (`instance.py`) and the torch worker.

Three stages: incremental detokenization (a token's text once it is whole UTF-8), stop
strings (the stop itself and anything after it never leave, `stops.py`), and coalescing into
one piece per stream interval, the first at once (each piece wakes the engine, NATS, the
gateway and the client: see `EngineSettings.stream_interval_s`; vLLM's `stream_interval`).
Pure, with the decoder and the clock passed in, so that tests drive it with a toy vocabulary
and a fake clock; it imports no runtime.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from services.engine.detokenize import IncrementalDetokenizer
from services.engine.stops import StopMatcher
from shared.messages import TokenLogprob


@dataclass(frozen=True)
class Piece:
    text: str
    tokens: int
    """Tokens behind it (a token whose text is held back, mid-character or a possible stop,
    is counted in the piece that finally carries it)."""
    logprobs: tuple[TokenLogprob, ...] = ()


class TextStream:
    def __init__(
        self,
        decode: Callable[[list[int]], str],
        stops: StopMatcher,
        interval_s: float,
        clock: Callable[[], float],
    ) -> None:
        self._detok = IncrementalDetokenizer(decode)
        self._stops = stops
        self._interval_s = interval_s
        self._clock = clock
        self._last: float | None = None
        self._text: list[str] = []
        self._tokens = 0
        self._logprobs: list[TokenLogprob] = []

    @property
    def stopped(self) -> bool:
        """A stop string was reached: the request ends with finish reason "stop"."""
        return self._stops.stopped

    def add(self, token: int, logprob: TokenLogprob | None = None) -> Piece | None:
        """One generated token; the piece to send now, if one is due."""
        self._tokens += 1
        if logprob is not None:
            self._logprobs.append(logprob)
        piece = self._detok.add(token)
        if piece:
            self._text.append(self._stops.feed(piece))
        now = self._clock()
        if self.stopped or (any(self._text) and (self._last is None or now - self._last >= self._interval_s)):
            return self._take(now)
        return None

    def end(self) -> Piece | None:
        """The generation ended: whatever is still held (the last piece, possibly of no text
        but with tokens, so that the stream counts every token)."""
        if not self.stopped:
            self._text.append(self._stops.feed(self._detok.flush()))
            self._text.append(self._stops.flush())
        if any(self._text) or self._tokens:
            return self._take(self._clock())
        return None

    def _take(self, now: float) -> Piece:
        piece = Piece("".join(self._text), self._tokens, tuple(self._logprobs))
        self._text.clear()
        self._tokens = 0
        self._logprobs.clear()
        self._last = now
        return piece

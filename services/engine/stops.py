"""Stop strings over a text stream: emit what is safe, hold back what might start a stop.

OpenAI semantics: the stop string itself never reaches the client, and nothing after it. A
suffix of the text that is a prefix of some stop string is held back until the next piece
decides it.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopMatcher:
    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(s for s in stops if s)
        self._held = ""
        self.stopped = False

    def feed(self, text: str) -> str:
        """Add decoded text; return the part that can be sent now."""
        if self.stopped:
            return ""
        if not self.stops:
            return text
        buf = self._held + text
        hits = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped = True
            self._held = ""
            return buf[: min(hits)]
        keep = self._longest_partial(buf)
        self._held = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep]

    def flush(self) -> str:
        """At the end of generation: whatever was held back is plain text after all."""
        held, self._held = self._held, ""
        return "" if self.stopped else held

    def _longest_partial(self, buf: str) -> int:
        best = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(buf)), best, -1):
                if buf.endswith(stop[:n]):
                    best = n
                    break
        return best

"""One request's text on the torch engine (`text_stream.py`, which the torch worker and the stateful tier share) with a toy vocabulary and a
fake clock: pieces per stream interval, the first at once; stop strings cut; a token whose
text is incomplete waits for the rest; every token is counted in some piece."""

from __future__ import annotations

import pytest

pytest.importorskip("torch", reason="the torch engine's package needs torch")

from services.engine.stops import StopMatcher
from services.engine.text_stream import Piece, TextStream
from shared.messages import TokenLogprob

VOCAB = {1: b"Hel", 2: b"lo", 3: b" wor", 4: b"ld", 5: b"\xc3", 6: b"\xa9", 7: b"!"}


def decode(ids: list[int]) -> str:
    return b"".join(VOCAB[i] for i in ids).decode("utf-8", errors="replace")


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def feed(stream: TextStream, clock: Clock, tokens: list[int], dt: float) -> list[Piece]:
    pieces = []
    for t in tokens:
        piece = stream.add(t)
        if piece is not None:
            pieces.append(piece)
        clock.now += dt
    end = stream.end()
    return pieces + ([end] if end is not None else [])


def test_the_first_piece_goes_at_once_and_later_ones_once_per_interval() -> None:
    clock = Clock()
    pieces = feed(TextStream(decode, StopMatcher(()), 0.1, clock), clock, [1, 2, 3, 4, 7], dt=0.04)
    assert "".join(p.text for p in pieces) == "Hello world!"
    assert pieces[0] == Piece("Hel", 1)  # at once
    assert len(pieces) < 5  # the rest coalesced
    assert sum(p.tokens for p in pieces) == 5


def test_a_split_character_waits_for_its_second_byte() -> None:
    clock = Clock()
    stream = TextStream(decode, StopMatcher(()), 0.0, clock)
    assert stream.add(5) is None  # half of "é": nothing to send yet
    assert stream.add(6) == Piece("é", 2)


def test_a_stop_string_ends_the_text_before_it_and_holds_back_what_might_start_it() -> None:
    clock = Clock()
    stream = TextStream(decode, StopMatcher((" wo",)), 0.0, clock)
    assert stream.add(1) == Piece("Hel", 1)
    assert stream.add(2) == Piece("lo", 1)
    piece = stream.add(3)
    assert stream.stopped
    assert piece == Piece("", 1)  # " wor" reached the stop: nothing of it leaves
    assert stream.end() is None


def test_text_held_as_a_possible_stop_is_sent_when_the_generation_ends() -> None:
    clock = Clock()
    stream = TextStream(decode, StopMatcher(("o!",)), 0.0, clock)
    assert stream.add(1) == Piece("Hel", 1)
    assert stream.add(2) == Piece("l", 1)  # its "o" may start "o!": held back
    assert stream.end() == Piece("o", 0)
    assert not stream.stopped


def test_logprobs_travel_with_the_piece_that_carries_their_tokens() -> None:
    clock = Clock()
    stream = TextStream(decode, StopMatcher(()), 0.0, clock)
    a, b = TokenLogprob(5, -0.5), TokenLogprob(6, -0.1)
    assert stream.add(5, a) is None
    assert stream.add(6, b) == Piece("é", 2, (a, b))

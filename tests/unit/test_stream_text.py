"""Every request's text in a worker (`text.StreamText`) with a toy byte-level vocabulary and a
fake clock: chunks per stream interval, the first at once, stretched for a crowd; every due
request decoded in one call; a character split over tokens kept whole; stop strings cut, at
the token that completes them, even across steps; logprobs with their tokens; nothing lost at
the end."""

from __future__ import annotations

from collections.abc import Sequence

from services.engine.text import Flushed, StreamText
from services.engine.worker_wire import Chunk
from shared.messages import TokenLogprob

# Token i decodes to these bytes; "é" is split over tokens 5 and 6.
VOCAB = {1: b"Hel", 2: b"lo", 3: b" w", 4: b"orld", 5: "é".encode()[:1], 6: "é".encode()[1:], 7: b"!"}


def decode(ids: Sequence[int]) -> str:
    return b"".join(VOCAB[i] for i in ids).decode("utf-8", errors="replace")


class Decoder:
    def __init__(self) -> None:
        self.calls: list[list[list[int]]] = []
        """The windows of each call (one call stands for the detokenizer runs of one flush)."""

    def __call__(self, seqs: Sequence[Sequence[int]]) -> list[str]:
        self.calls.append([list(s) for s in seqs])
        return [decode(s) for s in seqs]


def make(now: list[float], **kw: float) -> tuple[StreamText, Decoder]:
    d = Decoder()
    return StreamText(d, clock=lambda: now[0], **kw), d


def toks(*ids: int) -> list[tuple[int, TokenLogprob | None]]:
    return [(i, None) for i in ids]


def test_the_first_text_goes_at_once_then_once_per_interval() -> None:
    now = [0.0]
    text, _ = make(now)
    text.open("a", 0.05)
    text.write("a", toks(1))
    assert text.flush().chunks == [Chunk("a", "Hel", 1)]
    now[0] = 0.01
    text.write("a", toks(2))
    now[0] = 0.02
    text.write("a", toks(3))
    assert text.flush().chunks == []  # held within the interval
    now[0] = 0.07
    text.write("a", toks(4))
    assert text.flush().chunks == [Chunk("a", "lo world", 3)]
    now[0] = 0.08
    text.write("a", toks(7))
    text.end("a")
    assert text.flush().chunks == [Chunk("a", "!", 1)]
    assert len(text) == 0  # an ended stream is forgotten


def test_every_due_request_is_decoded_in_one_call() -> None:
    now = [0.0]
    text, decoder = make(now)
    for i in range(8):
        text.open(str(i), 0.05)
        text.write(str(i), toks(1, 2))
    chunks = text.flush().chunks
    assert [len(c) for c in decoder.calls] == [16]  # 8 requests, two windows each, one call
    assert sorted(c.request_id for c in chunks) == [str(i) for i in range(8)]
    assert {c.text for c in chunks} == {"Hello"}


def test_a_request_without_stops_is_not_decoded_until_its_chunk_is_due() -> None:
    now = [0.0]
    text, decoder = make(now)
    text.open("a", 0.05)
    text.write("a", toks(1))
    text.flush()
    text.write("a", toks(2))
    calls = len(decoder.calls)
    assert text.flush().chunks == [] and len(decoder.calls) == calls  # not due: no detokenizer run


def test_a_character_split_over_tokens_waits_for_its_other_half() -> None:
    now = [0.0]
    text, _ = make(now)
    text.open("a", 0.0)
    text.write("a", toks(1, 5))
    assert text.flush().chunks == []  # "Hel" + half an "é": nothing whole to send yet
    text.write("a", toks(6))
    assert text.flush().chunks == [Chunk("a", "Helé", 3)]  # the held tokens go with the text


def test_the_text_of_an_ended_stream_adds_up_to_the_whole_decode() -> None:
    now = [0.0]
    text, _ = make(now)
    ids = [1, 2, 5, 6, 3, 4, 7, 5]
    text.open("a", 0.05)
    out: list[Chunk] = []
    for i, t in enumerate(ids):
        now[0] = i * 0.02
        text.write("a", toks(t))
        out += text.flush().chunks
    text.end("a")
    out += text.flush().chunks
    assert "".join(c.text for c in out) == decode(ids)
    assert sum(c.tokens for c in out) == len(ids)


def test_an_ended_stream_with_nothing_new_sends_nothing_and_decodes_nothing() -> None:
    now = [0.0]
    text, decoder = make(now)
    text.open("a", 0.05)
    text.write("a", toks(1))
    text.flush()
    calls = len(decoder.calls)
    text.end("a")
    assert text.flush().chunks == []
    assert len(text) == 0 and len(decoder.calls) == calls


def test_a_crowd_shares_a_chunk_rate_and_each_stream_waits_longer() -> None:
    now = [0.0]
    text, _ = make(now, chunks_per_s=100.0)
    for i in range(20):  # 20 streams: one chunk each per 0.2 s
        text.open(str(i), 0.05)
        text.write(str(i), toks(1))
    assert len(text.flush().chunks) == 20  # first text at once, crowd or not
    for i in range(20):
        text.write(str(i), toks(2))
    now[0] = 0.1  # past each stream's own interval, within the crowd's
    assert text.flush().chunks == []
    now[0] = 0.2
    assert len(text.flush().chunks) == 20
    lone, _ = make(now, chunks_per_s=100.0)
    lone.open("a", 0.05)
    lone.write("a", toks(1))
    lone.flush()
    lone.write("a", toks(2))
    now[0] = 0.26  # alone, its own interval holds
    assert lone.flush().chunks == [Chunk("a", "lo", 1)]


def test_a_chunk_carries_the_logprobs_of_its_tokens() -> None:
    now = [0.0]
    text, _ = make(now)
    text.open("r", 0.1)
    a, b, c = TokenLogprob(1, -0.5), TokenLogprob(2, -0.25), TokenLogprob(3, -1.0)
    text.write("r", [(1, a), (2, b)])
    first = text.flush().chunks
    text.write("r", [(3, c)])
    now[0] += 1.0
    text.end("r")
    rest = text.flush().chunks
    assert [lp for ch in first + rest for lp in ch.logprobs] == [a, b, c]
    assert sum(ch.tokens for ch in first + rest) == 3


def test_a_stop_string_ends_the_text_before_it_at_the_token_that_completes_it() -> None:
    now = [0.0]
    text, _ = make(now)
    text.open("a", 0.0, (" wo",))
    text.write("a", toks(1, 2, 3, 4, 7))  # one step of five tokens: " w" + "orld" holds the stop
    flushed = text.flush()
    assert "".join(c.text for c in flushed.chunks) == "Hello"
    assert flushed.stopped == {"a": 4}  # it took four tokens: the stop is complete at the fourth
    assert sum(c.tokens for c in flushed.chunks) == 4
    assert len(text) == 0


def test_a_stop_string_split_across_steps_is_held_back_then_cut() -> None:
    now = [0.0]
    text, _ = make(now)
    text.open("a", 10.0, ("o w",))  # a long interval: only the first text goes before the stop
    text.write("a", toks(1))
    assert text.flush().chunks == [Chunk("a", "Hel", 1)]
    text.write("a", toks(2))  # its "o" may begin the stop: held
    assert text.flush() == Flushed([], {})
    text.write("a", toks(3))  # " w" completes it: the text before it goes at once
    assert text.flush() == Flushed([Chunk("a", "l", 2)], {"a": 3})


def test_text_held_as_a_possible_stop_is_sent_when_the_generation_ends() -> None:
    now = [0.0]
    text, _ = make(now)
    text.open("a", 0.0, ("o!",))
    text.write("a", toks(1))
    assert text.flush().chunks == [Chunk("a", "Hel", 1)]
    now[0] = 1.0
    text.write("a", toks(2))
    assert text.flush().chunks == [Chunk("a", "l", 1)]  # its "o" may start "o!": held back
    text.end("a")
    flushed = text.flush()
    assert flushed.chunks == [Chunk("a", "o", 0)] and flushed.stopped == {}

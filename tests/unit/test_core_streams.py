"""The core's text: tokens held per stream interval, every due request detokenized in one
batch, characters split over tokens kept whole, and nothing lost at the end."""

from collections.abc import Sequence

from services.engine.streams import Chunk, CoreStreams

# A toy byte-level vocabulary: token i decodes to these bytes; "é" is split over two tokens.
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


def make(now: list[float]) -> tuple[CoreStreams, Decoder]:
    d = Decoder()
    return CoreStreams(d, clock=lambda: now[0]), d


def test_the_first_text_goes_at_once_then_once_per_interval() -> None:
    now = [0.0]
    streams, _ = make(now)
    sink = streams.open("a", 0.05)
    sink.write([1])
    assert streams.flush() == [Chunk("a", "Hel", 1)]
    now[0] = 0.01
    sink.write([2])
    now[0] = 0.02
    sink.write([3])
    assert streams.flush() == []  # held within the interval
    now[0] = 0.07
    sink.write([4])
    assert streams.flush() == [Chunk("a", "lo world", 3)]
    now[0] = 0.08
    sink.write([7])
    sink.end()
    assert streams.flush() == [Chunk("a", "!", 1)]
    assert len(streams) == 0  # an ended stream is forgotten


def test_every_due_request_is_decoded_in_one_call() -> None:
    now = [0.0]
    streams, decoder = make(now)
    sinks = [streams.open(str(i), 0.05) for i in range(8)]
    for sink in sinks:
        sink.write([1, 2])
    chunks = streams.flush()
    assert [len(c) for c in decoder.calls] == [16]  # 8 requests, two windows each, one call
    assert sorted(c.request_id for c in chunks) == [str(i) for i in range(8)]
    assert {c.text for c in chunks} == {"Hello"}


def test_a_character_split_over_tokens_waits_for_its_other_half() -> None:
    now = [0.0]
    streams, _ = make(now)
    sink = streams.open("a", 0.0)
    sink.write([1, 5])
    assert streams.flush() == []  # "Hel" + half an "é": nothing whole to send yet
    sink.write([6])
    assert streams.flush() == [Chunk("a", "Helé", 3)]  # the held tokens go with the text


def test_the_text_of_an_ended_stream_adds_up_to_the_whole_decode() -> None:
    now = [0.0]
    streams, _ = make(now)
    ids = [1, 2, 5, 6, 3, 4, 7, 5]
    sink = streams.open("a", 0.05)
    out: list[Chunk] = []
    for i, t in enumerate(ids):
        now[0] = i * 0.02
        sink.write([t])
        out += streams.flush()
    sink.end()
    out += streams.flush()
    assert "".join(c.text for c in out) == decode(ids)
    assert sum(c.tokens for c in out) == len(ids)


def test_an_ended_stream_with_nothing_new_sends_nothing_and_decodes_nothing() -> None:
    now = [0.0]
    streams, decoder = make(now)
    sink = streams.open("a", 0.05)
    sink.write([1])
    streams.flush()
    sink.end()
    assert streams.flush() == []
    assert len(streams) == 0
    assert decoder.calls[-1] == [[], []]  # its windows are empty: no detokenizer run


def test_a_crowd_shares_a_chunk_rate_and_each_stream_waits_longer() -> None:
    now = [0.0]
    streams = CoreStreams(Decoder(), clock=lambda: now[0], chunks_per_s=100.0)
    sinks = [streams.open(str(i), 0.05) for i in range(20)]  # 20 streams: one chunk each per 0.2 s
    for sink in sinks:
        sink.write([1])
    assert len(streams.flush()) == 20  # first text at once, crowd or not
    for sink in sinks:
        sink.write([2])
    now[0] = 0.1  # past each stream's own interval, within the crowd's
    assert streams.flush() == []
    now[0] = 0.2
    assert len(streams.flush()) == 20
    sinks[0].end()
    assert [c.request_id for c in streams.flush()] == []  # nothing pending: ends silently
    lone = CoreStreams(Decoder(), clock=lambda: now[0], chunks_per_s=100.0)
    sink = lone.open("a", 0.05)
    sink.write([1])
    lone.flush()
    sink.write([2])
    now[0] = 0.26  # alone, its own interval holds
    assert lone.flush() == [Chunk("a", "lo", 1)]


def test_a_piece_carries_the_logprobs_of_its_tokens() -> None:
    now = [0.0]
    streams, _ = make(now)
    sink = streams.open("r", 0.1)
    sink.write([1, 2], [-0.5, -0.25])
    first = streams.flush()
    sink.write([3], [-1.0])
    now[0] += 1.0
    sink.end()
    rest = streams.flush()
    got = [(e.token, e.logprob) for c in first + rest for e in c.logprobs]
    assert got == [(1, -0.5), (2, -0.25), (3, -1.0)]
    assert sum(c.tokens for c in first + rest) == 3

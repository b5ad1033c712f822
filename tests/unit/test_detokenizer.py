from services.engine.text import IncrementalDetokenizer

# A toy byte-level vocabulary: token i decodes to these bytes; "é" is split over two tokens.
VOCAB = {1: b"Hel", 2: b"lo", 3: b" w", 4: b"orld", 5: "é".encode()[:1], 6: "é".encode()[1:], 7: b"!"}


def decode(ids: list[int]) -> str:
    return b"".join(VOCAB[i] for i in ids).decode("utf-8", errors="replace")


class Detok:
    """The detokenizer driven one call at a time, as `StreamText` drives it in batches."""

    def __init__(self) -> None:
        self.d = IncrementalDetokenizer()

    def add(self, *tokens: int) -> str:
        self.d.extend(tokens)
        before, after = self.d.windows()
        return self.d.settle(decode(before), decode(after))

    def flush(self) -> str:
        before, after = self.d.windows()
        return self.d.settle(decode(before), decode(after), final=True)


def test_each_token_is_emitted_as_soon_as_it_decodes() -> None:
    d = Detok()
    assert [d.add(t) for t in (1, 2, 3, 4)] == ["Hel", "lo", " w", "orld"]


def test_a_character_split_over_tokens_waits_for_its_last_byte() -> None:
    d = Detok()
    assert d.add(1) == "Hel"
    assert d.add(5) == ""
    assert d.add(6) == "é"
    assert d.add(7) == "!"


def test_the_pieces_add_up_to_the_whole_decode() -> None:
    ids = [1, 2, 5, 6, 3, 4, 7, 5]
    d = Detok()
    text = "".join(d.add(t) for t in ids) + d.flush()
    assert text == decode(ids)


def test_several_tokens_at_once_give_their_text_together() -> None:
    d = Detok()
    assert d.add(1, 2) == "Hello"
    assert d.add(5) == ""  # half a character waits for its other half
    assert d.add(6, 7) == "é!"

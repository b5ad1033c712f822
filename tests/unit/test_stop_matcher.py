from services.engine.text import StopMatcher


def feed_all(m: StopMatcher, pieces: list[str]) -> str:
    return "".join(m.feed(p) for p in pieces) + m.flush()


def test_text_without_stops_passes_straight_through() -> None:
    m = StopMatcher([])
    assert m.feed("abc") == "abc"
    assert not m.stopped


def test_stop_split_across_pieces_is_never_emitted() -> None:
    m = StopMatcher(["END"])
    assert m.feed("hello E") == "hello "
    assert m.feed("N") == ""
    assert m.feed("D and more") == ""
    assert m.stopped
    assert m.flush() == ""


def test_held_back_prefix_is_released_when_it_turns_out_not_to_be_a_stop() -> None:
    m = StopMatcher(["END"])
    assert m.feed("an E") == "an "
    assert m.feed("lephant") == "Elephant"


def test_text_held_at_the_end_of_generation_is_flushed() -> None:
    m = StopMatcher(["\n\n"])
    assert feed_all(m, ["line one", "\n"]) == "line one\n"
    assert not m.stopped


def test_earliest_of_several_stops_wins() -> None:
    m = StopMatcher(["world", "lo"])
    assert feed_all(m, ["hello world"]) == "hel"


def test_nothing_is_emitted_after_a_stop() -> None:
    m = StopMatcher(["."])
    assert m.feed("One. Two") == "One"
    assert m.feed(" three") == ""

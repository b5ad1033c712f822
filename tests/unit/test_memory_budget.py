from hypothesis import given
from hypothesis import strategies as st

from services.memory_manager.policy import Budget


def test_reservation_that_fits_is_granted_and_counted() -> None:
    b = Budget(100)
    assert b.reserve("m", 60)
    assert not b.reserve("n", 50)
    assert b.used_bytes == 60


def test_releasing_a_model_frees_its_weights_and_kv() -> None:
    b = Budget(100)
    b.reserve("m", 40)
    b.reserve("m:kv", 30)
    b.reserve("mm", 10)  # a different model whose name starts the same
    assert b.release("m") == 70
    assert b.held == {"mm": 10}


def test_release_all_empties_the_node() -> None:
    b = Budget(100)
    b.reserve("a", 10)
    b.reserve("b", 10)
    b.release("*")
    assert b.used_bytes == 0


def test_a_new_reservation_by_the_same_owner_replaces_the_old() -> None:
    b = Budget(100)
    b.reserve("m", 90)
    assert b.reserve("m", 95)
    assert b.used_bytes == 95


ops = st.lists(
    st.tuples(st.sampled_from(["reserve", "release"]), st.sampled_from(["a", "a:kv", "b", "c", "*"]),
              st.integers(min_value=-5, max_value=80)),
    max_size=50,
)


@given(ops)
def test_the_budget_is_never_exceeded(sequence: list[tuple[str, str, int]]) -> None:
    b = Budget(100)
    for op, owner, n in sequence:
        if op == "reserve":
            b.reserve(owner, n)
        else:
            b.release(owner)
        assert 0 <= b.used_bytes <= 100

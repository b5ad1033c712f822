"""Which queued requests form the next batch: in order, within max_batch and the KV budget."""

from __future__ import annotations

from services.engine.batch import batch_tokens, joinable, take_batch


def test_rows_are_padded_to_the_longest_prompt_and_completion() -> None:
    assert batch_tokens([10, 30], [5, 20]) == 2 * (30 + 20)


def test_takes_everything_queued_when_it_fits() -> None:
    assert take_batch([(10, 16)] * 5, max_batch=16, kv_tokens=2048) == 5


def test_stops_at_max_batch() -> None:
    assert take_batch([(10, 16)] * 20, max_batch=16, kv_tokens=2048) == 16


def test_stops_where_the_next_request_would_overflow_the_kv_budget() -> None:
    # 3 rows of (100 + 100) fill 600 positions; a 4th, longer one would pad all to 4 × 400.
    queue = [(100, 100)] * 3 + [(300, 100), (10, 10)]
    assert take_batch(queue, max_batch=16, kv_tokens=1000) == 3


def test_the_first_request_always_runs_even_alone_over_budget() -> None:
    # A request using the whole context (the default max_tokens) runs, alone.
    assert take_batch([(100, 8092), (10, 10)], max_batch=16, kv_tokens=8192) == 1
    assert take_batch([(100, 9000)], max_batch=16, kv_tokens=8192) == 1


def test_a_batch_of_one_when_batching_is_off() -> None:
    assert take_batch([(10, 16)] * 4, max_batch=1, kv_tokens=2048) == 1


def test_queued_requests_join_a_running_batch_while_recomputing_it_is_cheap() -> None:
    running = [(40, 20)]  # one row: 40 tokens of context, 20 left
    assert joinable(running, [(30, 16)] * 3, max_batch=16, kv_tokens=2048, recompute_tokens=256) == 3
    assert joinable(running, [(30, 16)] * 3, max_batch=2, kv_tokens=2048, recompute_tokens=256) == 1
    # Re-prefilling 300 tokens of running rows costs more than the newcomers would wait.
    assert joinable([(300, 20)], [(30, 16)], max_batch=16, kv_tokens=2048, recompute_tokens=256) == 0
    # Nor beyond the KV budget: 3 rows × (100 + 100).
    assert joinable([(100, 100)], [(100, 100)] * 3, max_batch=16, kv_tokens=600, recompute_tokens=256) == 2
    assert joinable([], [(30, 16)], max_batch=16, kv_tokens=2048, recompute_tokens=256) == 0

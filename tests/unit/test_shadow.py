from dataclasses import dataclass

from policy.perf_model import profile
from policy.shadow import (
    Failure,
    NewRequest,
    Pending,
    ShadowInstance,
    order_candidates,
    validate,
)

# One decode iteration 0.05 s per instance, a prefill 0.001 s per token.
PERF = profile(lambda n: 0.001 * n, lambda b, n: 0.05)


def inst(key: str, batch: int = 1, least: float = 1.0, pending=(), ready_in_s: float = 0.0):
    return ShadowInstance(key, PERF, batch, 512.0, least if batch else float("inf"), tuple(pending), ready_in_s)


def test_a_request_that_fits_is_accepted() -> None:
    v = validate([inst("a"), inst("b")], "a", NewRequest(512, 2.0, 0.25))
    assert v.ok


def test_case1_the_new_requests_prefill_ends_too_late() -> None:
    v = validate([inst("a", least=10.0)], "a", NewRequest(1500, 1.0, 0.25))
    assert not v.ok and v.failure is Failure.NEW_LATE


def test_case2_an_existing_request_goes_negative() -> None:
    # "a" holds a request waiting for its prefill (0.55 s with 10%) with 0.5 s of headroom
    # only once the new request's prefill runs ahead of it.
    node = [inst("a", batch=0, pending=[Pending(500, 0.9)]), inst("b", batch=0)]
    v = validate(node, "b", NewRequest(500, 0.7, 0.25))
    assert not v.ok and v.failure is Failure.EXISTING_LATE


def test_case3_the_decode_round_over_all_instances_exceeds_tpot() -> None:
    node = [inst(k, least=5.0) for k in "abcde"]  # 5 x 0.05 x 1.1 = 0.275 > 0.25
    v = validate(node, "a", NewRequest(16, 5.0, 0.25))
    assert not v.ok and v.failure is Failure.ROUND_TOO_LONG


def test_iterations_are_overestimated_by_ten_percent() -> None:
    node = [inst(k, least=5.0) for k in "abcd"]  # 4 x 0.05 = 0.2; 0.22 with 10%
    assert validate(node, "a", NewRequest(16, 5.0, 0.21)).failure is Failure.ROUND_TOO_LONG
    assert validate(node, "a", NewRequest(16, 5.0, 0.23)).ok


def test_a_start_still_loading_delays_the_first_token() -> None:
    node = [inst("new", batch=0, ready_in_s=1.9)]
    assert not validate(node, "new", NewRequest(200, 2.0, 0.25)).ok
    assert validate(node, "new", NewRequest(200, 2.5, 0.25)).ok


def test_pending_prefills_of_other_instances_count() -> None:
    busy = inst("b", batch=0, pending=[Pending(1200, 1.5)])
    v = validate([inst("a", least=5.0), busy], "a", NewRequest(600, 1.4, 0.25))
    assert not v.ok


@dataclass
class C:
    name: str
    kind: str
    batch: int


def test_candidates_go_cpu_first_then_highest_batch_first() -> None:
    cs = [C("g8", "gpu", 8), C("c1", "cpu", 1), C("c4", "cpu", 4), C("g2", "gpu", 2)]
    assert [c.name for c in order_candidates(cs)] == ["c4", "c1", "g8", "g2"]

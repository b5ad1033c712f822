from hypothesis import given, settings
from hypothesis import strategies as st

from policy.station import MemOp, OpKind, Refused, Station, load, resize_kv, unload


def test_a_grow_that_would_exceed_the_optimistic_budget_is_refused() -> None:
    s = Station(100)
    assert s.issue(load(1, "a", 70)) is None
    assert s.issue(load(2, "b", 40)) is Refused.OVER_BUDGET


def test_a_scale_down_lowers_the_budget_at_once_but_a_grow_waits_for_it_to_complete() -> None:
    # §6.3: a scale-up right after a scale-down would OOM if both ran.
    s = Station(100)
    s.issue(load(1, "a", 80))
    [first] = s.dispatch()
    s.complete(first.op_id)
    assert s.issue(unload(2, "a", 80)) is None
    assert s.issue(load(3, "b", 60)) is None  # fits the optimistic budget already
    started = s.dispatch()
    assert [o.op_id for o in started] == [2]  # the grow waits in the station
    assert s.pessimistic_bytes == 80
    s.complete(2)
    assert [o.op_id for o in s.dispatch()] == [3]


def test_independent_instructions_issue_out_of_order() -> None:
    s = Station(100)
    s.issue(load(1, "a", 50))
    s.dispatch()
    s.issue(resize_kv(2, "a", 0, 10))  # reads a: waits for the load (RAW)
    s.issue(load(3, "b", 20))  # independent: may start before op 2
    assert [o.op_id for o in s.dispatch()] == [3]
    s.complete(1)
    assert [o.op_id for o in s.dispatch()] == [2]


def test_an_operation_with_a_stale_size_is_refused() -> None:
    s = Station(100)
    s.issue(load(1, "a", 10))
    assert s.issue(resize_kv(2, "a", 5, 20)) is Refused.STALE_SIZE


def test_a_later_grow_does_not_starve_an_earlier_one() -> None:
    s = Station(10)
    s.issue(load(1, "y", 5))
    s.complete(s.dispatch()[0].op_id)
    s.issue(unload(2, "y", 5))
    s.issue(load(3, "x", 6))
    s.issue(load(4, "z", 4))  # fits beside y, but would take what x waits for
    assert [o.op_id for o in s.dispatch()] == [2]


ops = st.lists(
    st.tuples(
        st.sampled_from(["grow", "shrink", "complete", "complete"]),
        st.sampled_from(["a", "b", "c", "a:kv", "b:kv"]),
        st.integers(1, 60),
    ),
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(ops, st.integers(0, 2**16))
def test_never_two_conflicting_running_and_never_over_budget(script, pick) -> None:
    s = Station(100)
    next_id = 0
    for action, region, n in script:
        if action == "complete":
            if s.running:
                keys = sorted(s.running)
                s.complete(keys[pick % len(keys)])
        else:
            next_id += 1
            cur = s.size(region)
            new = cur + n if action == "grow" else max(0, cur - n)
            reads = frozenset({region.split(":")[0]}) if region.endswith(":kv") else frozenset()
            op = MemOp(next_id, OpKind.RESIZE, region, cur, new, reads)
            s.issue(op)
        s.dispatch()
        running = list(s.running.values())
        for i, x in enumerate(running):
            for y in running[i + 1 :]:
                assert not x.conflicts(y)
        assert s.pessimistic_bytes <= s.budget_bytes
        assert s.optimistic_bytes <= s.budget_bytes
    # Liveness: completing what runs always drains the station.
    for _ in range(10 * (len(script) + 1)):
        if s.idle():
            break
        for op_id in list(s.running):
            s.complete(op_id)
        s.dispatch()
    assert s.idle()
    assert sum(s.physical.values()) == s.optimistic_bytes

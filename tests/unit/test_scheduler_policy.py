from policy.scheduling import (
    AwaitStart,
    NodeView,
    StartOn,
    StartUnderWay,
    StopOrder,
    UseNode,
    idle_instances,
    place,
)
from shared.messages import ErrorCode, InstanceView, Rejected

NOW = 1000.0


def inst(model: str, active: int = 0, last_used: float = NOW) -> InstanceView:
    return InstanceView(model=model, active=active, last_used=last_used, loaded_at=NOW - 100)


def node(node_id: str, *instances: InstanceView, seen: float = NOW, starting: frozenset[str] = frozenset()) -> NodeView:
    return NodeView(node_id, seen, {i.model: i for i in instances}, starting)


def decide(model: str, nodes: list[NodeView], starts: dict[str, str] | None = None):
    return place(
        model,
        nodes,
        {m: StartUnderWay(n) for m, n in (starts or {}).items()},
        NOW,
        node_timeout_s=3.0,
        max_active_per_instance=4,
    )


def test_request_goes_to_the_least_busy_running_instance() -> None:
    nodes = [node("a", inst("m", active=3)), node("b", inst("m", active=1))]
    assert decide("m", nodes) == UseNode("b")


def test_model_with_no_instance_is_started_on_the_least_loaded_node() -> None:
    nodes = [node("a", inst("x"), inst("y")), node("b", inst("z"))]
    assert decide("m", nodes) == StartOn("b")


def test_second_request_during_a_start_waits_for_it_instead_of_starting_again() -> None:
    assert decide("m", [node("a"), node("b")], {"m": "a"}) == AwaitStart("a")


def test_instance_at_its_concurrency_limit_rejects_with_retry_after() -> None:
    d = decide("m", [node("a", inst("m", active=4))])
    assert isinstance(d, Rejected) and d.code == ErrorCode.OVERLOADED and d.retry_after_s


def test_nodes_with_stale_heartbeats_get_no_work() -> None:
    nodes = [node("dead", inst("m"), seen=NOW - 10), node("live")]
    assert decide("m", nodes) == StartOn("live")


def test_no_live_node_is_unavailable() -> None:
    d = decide("m", [node("dead", seen=NOW - 10)])
    assert isinstance(d, Rejected) and d.code == ErrorCode.UNAVAILABLE


def test_idle_instance_past_keep_alive_is_stopped_with_its_idle_time() -> None:
    nodes = [node("a", inst("m", last_used=NOW - 5), inst("busy", active=1, last_used=NOW - 50), inst("fresh"))]
    orders = idle_instances(nodes, {"m": 2.0, "busy": 2.0, "fresh": 2.0}, {}, NOW)
    assert orders == [StopOrder("a", "m", NOW - 5)]


def test_a_recent_placement_keeps_an_instance_alive_before_its_request_arrives() -> None:
    nodes = [node("a", inst("m", last_used=NOW - 5))]
    assert idle_instances(nodes, {"m": 2.0}, {("a", "m"): NOW - 1}, NOW) == []


def test_instance_of_a_removed_model_is_stopped() -> None:
    nodes = [node("a", inst("gone"))]
    assert idle_instances(nodes, {}, {}, NOW) == [StopOrder("a", "gone", NOW)]


def test_exclusive_placement_gives_each_model_a_node_of_its_own() -> None:
    def excl(model: str, nodes: list[NodeView]):
        return place(model, nodes, {}, NOW, node_timeout_s=3.0, max_active_per_instance=4, exclusive=True)

    assert excl("m", [node("a", inst("x")), node("b")]) == StartOn("b")
    assert excl("m", [node("a", inst("m", active=3)), node("b")]) == UseNode("a")  # queues, no scale-out
    starting = place(
        "m",
        [node("a", inst("x")), node("b")],
        {"y": StartUnderWay("b")},
        NOW,
        node_timeout_s=3.0,
        max_active_per_instance=4,
        exclusive=True,
    )
    assert isinstance(starting, Rejected)  # "b" is taken by y's start, not yet in a heartbeat
    full = excl("m", [node("a", inst("x")), node("b", inst("y"))])
    assert isinstance(full, Rejected) and full.code == ErrorCode.NO_CAPACITY and full.retry_after_s


def test_first_requests_of_several_models_at_once_start_on_different_nodes() -> None:
    # No heartbeat shows the starts yet: the scheduler counts the ones it has ordered.
    nodes = [node("a"), node("b"), node("c")]
    starts: dict[str, str] = {}
    for model in ("m1", "m2", "m3"):
        decision = decide(model, nodes, starts)
        assert isinstance(decision, StartOn)
        starts[model] = decision.node_id
    assert sorted(starts.values()) == ["a", "b", "c"]

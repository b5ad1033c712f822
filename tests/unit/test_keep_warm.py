"""Keep warm (issue 35, part 1), the pure parts: priority before Tangram's cost in evictions and
preemptions, pinned models taken only for a higher priority, no scale-in below min_instances,
the restore decision after a node restart, and whether a pinned set fits the nodes."""

from __future__ import annotations

import math

import msgspec

from policy.adapter_turns import AdapterUse, idle_adapters
from policy.defrag import Neighbour, choose_preemption
from policy.eviction import Resident, choose_evictions, may_take
from policy.keep_warm import Need, fit, need_of, pinned, restore, with_adapter_pins
from policy.placement import Profile
from policy.scheduling import NodeView, StopOrder, UseNode, idle_instances, place
from shared.adapters import AdapterArtifact, AdapterRecord, adapter_ref
from shared.messages import AdapterRef, Artifact, InstanceView, ModelRecord
from tests.unit.test_placement import NOW as PLACED_AT
from tests.unit.test_placement import PERF, demand, profile
from tests.unit.test_placement import inst as busy
from tests.unit.test_placement import node as pnode

NOW = 10_000.0


def resident(key: str, reload_s: float = 1.0, priority: int = 0, pinned: bool = False) -> Resident:
    return Resident(key, 100, reload_s, NOW - 600, NOW - 10, priority=priority, pinned=pinned)


def test_a_lower_priority_is_evicted_before_a_cheaper_one_of_higher_priority() -> None:
    dear_low = resident("dear-low", reload_s=50.0, priority=0)
    cheap_high = resident("cheap-high", reload_s=0.1, priority=5)
    assert choose_evictions([dear_low, cheap_high], 100, NOW) == ["dear-low"]
    # At one priority, the cost decides as before.
    assert choose_evictions([resident("dear", 50.0), resident("cheap", 0.1)], 100, NOW) == ["cheap"]


def test_a_pinned_resident_goes_only_for_a_model_of_higher_priority() -> None:
    kept = resident("kept", reload_s=0.1, priority=2, pinned=True)
    other = resident("other", reload_s=50.0, priority=2)
    assert choose_evictions([kept, other], 100, NOW) == ["other"]
    # Room only the pinned one can make: not for no one in particular, nor for priority 2 ...
    assert choose_evictions([kept, other], 200, NOW) == []
    assert choose_evictions([kept, other], 200, NOW, for_priority=2) == []
    # ... but for a higher priority.
    assert sorted(choose_evictions([kept, other], 200, NOW, for_priority=3)) == ["kept", "other"]
    assert may_take(0, False, None) and not may_take(0, True, None) and may_take(0, True, 1)


def test_preemption_takes_lower_priorities_first_and_spares_pinned_neighbours() -> None:
    low = Neighbour("low", batch=2, nbytes=60, relocatable=True, priority=-1)
    small = Neighbour("small", batch=1, nbytes=60, relocatable=True)
    plan = choose_preemption(5, 60, [small, low])
    assert plan is not None and plan.victims == ("low",)  # before the smaller batch
    pin = Neighbour("pin", batch=1, nbytes=60, relocatable=True, pinned=True)
    assert choose_preemption(5, 60, [pin]) is None
    assert choose_preemption(5, 60, [pin], for_priority=1) is not None


def test_placement_preempts_no_pinned_neighbour_for_a_lower_priority() -> None:
    # As test_placement's §7.1 case: "m" (3 requests) beside o1 (1) and o2 (2), o1 preempted
    # first (the smaller batch) ...
    tight = Profile(PERF, 60.0, 0.05, "a1", weight_bytes=100, kv_bytes=10)
    nodes = [pnode("a", busy("m", 3), busy("o1", 1), busy("o2", 2)), pnode("b")]
    profiles = {"m": profile(ttft=60.0, tpot=1.0), "o1": tight, "o2": tight}
    d = demand(ttft=60.0, tpot=1.0)

    def decide(priorities: dict[str, int], pins: frozenset[str] = frozenset()) -> object:
        return place(
            "m",
            nodes,
            {},
            PLACED_AT,
            node_timeout_s=3,
            max_active_per_instance=16,
            demand=d,
            profiles=profiles,
            priorities=priorities,
            pinned=pins,
        )

    assert decide({}) == UseNode("a", preempt=("o1",))
    # ... unless o1 is pinned at m's priority: o2 goes instead; not so for a higher m.
    assert decide({}, frozenset({"o1"})) == UseNode("a", preempt=("o2",))
    assert decide({"m": 1}, frozenset({"o1"})) == UseNode("a", preempt=("o1",))
    # A lower priority goes first, whatever its batch.
    assert decide({"o1": 1}) == UseNode("a", preempt=("o2",))


def view(node_id: str, *models: str, last_used: float = NOW - 100, starting: frozenset[str] = frozenset()) -> NodeView:
    instances = {m: InstanceView(model=m, active=0, last_used=last_used, loaded_at=NOW - 200) for m in models}
    return NodeView(node_id, NOW, instances, starting, memory_budget_bytes=10_000)


def test_keep_alive_never_scales_a_pinned_model_below_its_min_instances() -> None:
    nodes = [view("a", "pin", "free", last_used=NOW - 50), view("b", "pin", last_used=NOW - 90)]
    keep = {"pin": 1.0, "free": 1.0}
    assert len(idle_instances(nodes, keep, {}, NOW)) == 3  # as today without a pin
    # Pinned to one: the idlest of its two goes, the other stays; the unpinned one goes.
    orders = idle_instances(nodes, keep, {}, NOW, {"pin": 1})
    assert sorted(orders, key=lambda o: o.model) == [StopOrder("a", "free", NOW - 50), StopOrder("b", "pin", NOW - 90)]
    assert idle_instances(nodes, keep, {}, NOW, {"pin": 2, "free": 1}) == []


def record(name: str, min_instances: int = 1, priority: int = 0, aid: str = "a1", weights: int = 100) -> ModelRecord:
    artifact = Artifact(
        artifact_id=aid,
        path="/x",
        source_sha256="s",
        context_length=1000,
        kv_bytes_per_token=1,
        weight_bytes=weights,
    )
    return ModelRecord(
        name=name,
        source="/x",
        artifact=artifact,
        ttft_slo_s=2.0,
        tpot_slo_s=0.1,
        keep_alive_s=1.0,
        created_at=0.0,
        min_instances=min_instances,
        priority=priority,
    )


def test_a_pinned_model_missing_after_a_node_restart_is_started_again() -> None:
    pin = record("pin")
    # The restarted node's heartbeat shows nothing: a start of it there.
    assert restore([pin, record("free", 0)], [view("a")], {}, NOW, {}) == [("pin", "a")]
    # Running or starting there: nothing to do.
    assert restore([pin], [view("a", "pin")], {}, NOW, {}) == []
    assert restore([pin], [view("a", starting=frozenset({"pin"}))], {}, NOW, {}) == []
    # Two instances wanted, one running: the other node.
    two = msgspec.structs.replace(pin, min_instances=2)
    assert restore([two], [view("a", "pin"), view("b")], {}, NOW, {}) == [("pin", "b")]


def test_a_failed_restore_is_retried_after_a_while_not_every_pass() -> None:
    pin = record("pin")
    assert restore([pin], [view("a")], {}, NOW, {"pin": NOW - 1}, retry_s=5) == []
    assert restore([pin], [view("a")], {}, NOW, {"pin": NOW - 6}, retry_s=5) == [("pin", "a")]


def test_restores_go_highest_priority_first() -> None:
    records = [record("low", priority=0), record("high", priority=9), record("mid", priority=3)]
    assert [r.name for r in pinned(records)] == ["high", "mid", "low"]
    assert [m for m, _ in restore(records, [view("a")], {}, NOW, {})] == ["high", "mid", "low"]


def test_pinned_models_fit_when_the_nodes_hold_them_all_at_once() -> None:
    # Two names on one artifact share its weights on a node: 100 + 2 × 50.
    a, b = Need("a", "x", 100, 50, 1), Need("b", "x", 100, 50, 1)
    assert fit([a, b], [200]).ok
    assert fit([a, b], [200]).needed_bytes == 200
    refused = fit([a, b, Need("c", "y", 100, 50, 1)], [300])
    assert not refused.ok and (refused.needed_bytes, refused.available_bytes) == (350, 300)
    # One instance of a model per node: two instances need two nodes, whatever the memory.
    assert not fit([Need("a", "x", 100, 50, 2)], [1000]).ok
    assert fit([Need("a", "x", 100, 50, 2)], [150, 150]).ok
    # Room in all but not on one node: refused too.
    assert not fit([Need("c", "y", 100, 50, 1)], [100, 100]).ok


def test_a_records_footprint_is_its_weights_and_its_kv_floor() -> None:
    r = record("m", weights=100)  # 1 KV byte per token, 1000 tokens of context
    assert need_of(r, kv_min_tokens=0) == Need("m", "a1", 100, 1000, 1)
    assert need_of(r, kv_min_tokens=256).kv_bytes == 256
    # Where the cache grows as its rows fill, no floor unless an operator set one.
    assert need_of(r, kv_min_tokens=256).kv_on_demand_bytes == 256


def test_a_pin_fits_without_the_kv_floor_on_a_node_whose_cache_grows_on_demand() -> None:
    # Weights 100 and a context's floor of 1000: a node of 500 holds it only where no floor is
    # booked ahead (OpenVINO's dynamic cache: a start books its weights alone).
    need = need_of(record("m", weights=100), kv_min_tokens=0)
    assert not fit([need], [500]).ok and not fit([need], [500], [False]).ok
    on_demand = fit([need], [500], [True])
    assert on_demand.ok and on_demand.needed_bytes == 100
    # Mixed nodes: each judged by its own cache; the instance fits where one holds it.
    assert fit([need], [500, 600], [False, True]).ok
    assert not fit([need], [500, 50], [False, True]).ok


def test_a_pinned_adapters_bytes_count_on_each_instance_of_its_base() -> None:
    # 100 of weights and 50 of KV fit a node of 150; the adapter's 10 more on it do not.
    assert fit([Need("a", "x", 100, 50, 1)], [150]).ok
    with_adapter = Need("a", "x", 100, 50, 1, adapter_bytes=10)
    assert not fit([with_adapter], [150]).ok
    assert fit([with_adapter], [160]).needed_bytes == 160
    assert need_of(record("m", weights=100), 0, adapter_bytes=10).adapter_bytes == 10


def adapter(name: str, base: str, min_instances: int = 0, priority: int = 0) -> AdapterRecord:
    kept = AdapterArtifact(
        adapter_id=name,
        path=f"/x/adapters/{name}",
        base_artifact_id="a1",
        rank=8,
        alpha=16.0,
        scale=2.0,
        targets=("q_proj",),
        layers=2,
        dtype="F32",
        nbytes=1 << 20,
        sha256="",
    )
    return AdapterRecord(
        name=name,
        base=base,
        source="/src",
        adapter=kept,
        keep_alive_s=1.0,
        ttft_slo_s=2.0,
        tpot_slo_s=0.1,
        created_at=0.0,
        min_instances=min_instances,
        priority=priority,
    )


def test_a_pinned_adapter_keeps_its_base_warm_at_the_higher_pin_and_priority() -> None:
    base, other = record("base", min_instances=0, priority=1), record("other", min_instances=0)
    adapters = [
        adapter("a", "base", min_instances=2, priority=0),
        adapter("b", "base", min_instances=1, priority=7),
        adapter("idle", "other"),  # not pinned: its base stays as registered
    ]
    got = {r.name: (r.min_instances, r.priority) for r in with_adapter_pins([base, other], adapters)}
    assert got == {"base": (2, 7), "other": (0, 0)}
    # A base pinned higher than its adapters keeps its own pin.
    [kept] = with_adapter_pins([record("base", min_instances=3, priority=9)], adapters)
    assert (kept.min_instances, kept.priority) == (3, 9)
    # Pinned through its adapter, the base is what restore starts.
    assert [r.name for r in pinned(with_adapter_pins([base, other], adapters))] == ["base"]
    # An unpinned adapter's priority raises its base's all the same.
    [raised] = with_adapter_pins([other], [adapter("urgent", "other", priority=4)])
    assert (raised.min_instances, raised.priority) == (0, 4)


def test_a_pinned_adapters_engine_never_drops_it_for_idleness() -> None:
    pinned_ref = adapter_ref(adapter("a", "base", min_instances=1))
    plain_ref = adapter_ref(adapter("b", "base"))
    assert plain_ref.keep_alive_s == 1.0 and math.isinf(pinned_ref.keep_alive_s)
    uses = {r.name: AdapterUse(r.keep_alive_s, last_used=NOW - 3600, active=0) for r in (pinned_ref, plain_ref)}
    assert idle_adapters(uses, NOW) == ["b"]
    # The reference survives the bus (msgpack carries an infinite float).
    assert math.isinf(msgspec.msgpack.decode(msgspec.msgpack.encode(pinned_ref), type=AdapterRef).keep_alive_s)

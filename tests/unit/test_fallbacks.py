"""Warm fallbacks (issue 35): an alias's first warm member within its SLOs serves, else its
first member; what an alias may list."""

from __future__ import annotations

from policy.fallbacks import alias_problem, choose
from policy.perf_model import DecodeSample, PerfModel, PrefillSample
from policy.placement import Demand, Profile
from policy.scheduling import NodeView
from shared.messages import InstanceView

NOW = 1000.0
# 2 ms per prompt token, 20 ms per decode iteration.
PERF = PerfModel.fit(
    [PrefillSample(1, 0.002), PrefillSample(1000, 2.0)], [DecodeSample(1, 1, 0.02), DecodeSample(1, 1000, 0.02)]
)
DEMAND = Demand(100, 50, 2.0, 0.1)


def inst(model: str, active: int = 0) -> InstanceView:
    return InstanceView(model=model, active=active, last_used=NOW, loaded_at=NOW - 10)


def node(node_id: str, *instances: InstanceView, seen: float = NOW) -> NodeView:
    return NodeView(node_id, seen, {i.model: i for i in instances})


def pick(members: list[str], nodes: list[NodeView], profiles: dict[str, Profile] | None = None) -> tuple[str, bool]:
    return choose(
        members,
        nodes,
        NOW,
        node_timeout_s=3.0,
        max_active_per_instance=4,
        demands={m: DEMAND for m in members},
        profiles=profiles or {},
    )


def test_the_first_warm_member_serves() -> None:
    assert pick(["big", "small"], [node("a", inst("small"))]) == ("small", True)
    assert pick(["big", "small"], [node("a", inst("small")), node("b", inst("big"))]) == ("big", True)


def test_with_no_warm_member_the_first_is_chosen_to_start() -> None:
    assert pick(["big", "small"], [node("a")]) == ("big", False)
    # An instance on a node whose heartbeat stopped is not warm.
    assert pick(["big", "small"], [node("a", inst("small"), seen=NOW - 10)]) == ("big", False)


def test_a_warm_member_at_its_limit_is_passed_over() -> None:
    assert pick(["small", "other"], [node("a", inst("small", active=4), inst("other"))]) == ("other", True)


def test_a_warm_member_that_would_miss_its_slo_is_passed_over() -> None:
    # Measured: three requests ahead on `big` (≈ 1.2 s of service each) put this one's first
    # token past its 2 s TTFT SLO; `small` is idle.
    profiles = {m: Profile(PERF, 2.0, 0.1, m) for m in ("big", "small")}
    nodes = [node("a", inst("big", active=3)), node("b", inst("small"))]
    assert pick(["big", "small"], nodes, profiles) == ("small", True)
    assert pick(["big", "small"], [node("a", inst("big", active=3))], profiles) == ("big", False)


def test_an_alias_lists_registered_models_once_and_no_alias() -> None:
    models, aliases = {"a", "b"}, {"other"}
    assert alias_problem("chat", ["a", "b"], models, aliases) is None
    assert "at least one" in (alias_problem("chat", [], models, aliases) or "")
    assert "`x` does not exist" in (alias_problem("chat", ["a", "x"], models, aliases) or "")
    assert "alias" in (alias_problem("chat", ["other"], models, aliases) or "")
    assert "cycle" in (alias_problem("chat", ["chat"], models | {"chat"}, aliases) or "")
    assert "twice" in (alias_problem("chat", ["a", "a"], models, aliases) or "")
    assert "at most" in (alias_problem("chat", ["a"] * 9, models, aliases) or "")

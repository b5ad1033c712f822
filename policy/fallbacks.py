"""Warm fallbacks (issue 35): an alias is an ordered list of models, and each request goes to
the first member that is warm and takes it within its SLOs, as the scheduler admits requests
(shadow validation, `scheduling.first_join`), else to the first member, which starts.

Also what an alias may list: registered models only (no alias of aliases, hence no cycle),
each once, at least one.

Pure: the cluster view, profiles and demands in; a member's name out.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet

from policy.placement import Demand, NodeState, Profile
from policy.scheduling import first_join, live_nodes
from shared.routing_messages import MAX_FALLBACKS


def alias_problem(name: str, members: Sequence[str], models: AbstractSet[str], aliases: AbstractSet[str]) -> str | None:
    """Why `name` may not be registered as an alias of `members` (None: it may), given the
    registered `models` and `aliases` (the names, other than `name` itself)."""
    if not members:
        return "an alias lists at least one model"
    if len(members) > MAX_FALLBACKS:
        return f"an alias lists at most {MAX_FALLBACKS} models, not {len(members)}"
    if name in members:
        return f"the alias `{name}` lists itself (a cycle)"
    seen: set[str] = set()
    for m in members:
        if m in seen:
            return f"`{m}` is listed twice"
        seen.add(m)
        if m in aliases:
            return f"`{m}` is an alias: an alias lists models, not aliases"
        if m not in models:
            return f"the model `{m}` does not exist"
    return None


def warm(
    model: str,
    nodes: Iterable[NodeState],
    *,
    max_active_per_instance: int,
    demand: Demand,
    profiles: Mapping[str, Profile],
) -> bool:
    """Whether an instance of `model` takes the request now: one that validates it (shadow
    validation), or, for a model never measured, one below its limit of requests."""
    running = [n for n in nodes if model in n.instances]
    if not running:
        return False
    joins = first_join(
        model, running, max_active_per_instance=max_active_per_instance, demand=demand, profiles=profiles
    )
    if joins is None:
        return any(n.instances[model].active < max_active_per_instance for n in running)
    return joins.joined is not None


def choose(
    members: Sequence[str],
    nodes: Iterable[NodeState],
    now: float,
    *,
    node_timeout_s: float,
    max_active_per_instance: int,
    demands: Mapping[str, Demand],
    profiles: Mapping[str, Profile],
) -> tuple[str, bool]:
    """The member that serves the request, and whether it is warm: the first warm one within
    its SLOs, else the first (which then starts). `demands`: the request as each member would
    judge it (its own TTFT SLO for the prompt)."""
    live = live_nodes(nodes, now, node_timeout_s)
    for m in members:
        if m in demands and warm(
            m, live, max_active_per_instance=max_active_per_instance, demand=demands[m], profiles=profiles
        ):
            return m, True
    return members[0], False

"""The scheduler's part in issue 35's serverless controls, between its state and the pure
policies: a request's cold-start budget (`policy.cold_budget`), the choice among an alias's
members (`policy.fallbacks`), and the load-time model read back from the cold-start log
after a restart. The service calls these with what it holds; they do no I/O but the
registry reads they are named for."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

from policy import cold_budget, fallbacks
from policy.perf_book import PerfBook
from policy.placement import Demand, Profile
from policy.scheduling import NodeView, StartUnderWay
from policy.slo import ttft_slo
from shared.messages import ErrorCode, ModelRecord, Rejected
from shared.registry import Registry
from shared.routing_messages import ChooseModel, ModelChosen, PlaceRequest


def over_budget(
    req: PlaceRequest,
    record: ModelRecord,
    node: NodeView | None,
    start: StartUnderWay | None,
    perf: PerfBook,
    profile: Profile | None,
    guess_s: float,
    now: float,
) -> Rejected | None:
    """The refusal of a request that would wait for a start of `record` on `node` (`start`:
    the one under way there) longer than its budget; None where it may wait (or has no budget)."""
    if req.max_wait_s is None:
        return None
    aid = record.artifact.artifact_id
    kind = node.kind if node is not None else "cpu"
    predicted = cold_budget.forecast(
        load_s=perf.load_s(aid, record.artifact.weight_bytes),
        guess_s=guess_s,
        spawn_s=perf.spawn_s(),
        resident=node is not None and aid in node.resident,
        prewarmed=node is None or node.prewarmed > 0,
        elapsed_s=now - start.since if start is not None else 0.0,
        waiting=start.waiting if start is not None else 0,
        prefill_s=profile.perf_on(kind).prefill_s(req.prompt_tokens) if profile is not None else 0.0,
    )
    return cold_budget.refusal(record.name, predicted, req.max_wait_s)


async def choose(
    req: ChooseModel,
    registry: Registry,
    nodes: Sequence[NodeView],
    profiles: Mapping[str, Profile],
    *,
    node_timeout_s: float,
    max_active_per_instance: int,
) -> ModelChosen | Rejected:
    """Which of `req.models` serves the request (`policy.fallbacks.choose`), each judged by its
    own SLOs for the request's prompt."""
    if not req.models:
        return Rejected(code=ErrorCode.INVALID_REQUEST, message="no model to choose from")
    demands: dict[str, Demand] = {}
    for name in req.models:
        record = await registry.get(name)
        if record is not None:
            slo = ttft_slo(record, req.prompt_tokens)
            demands[name] = Demand(req.prompt_tokens, req.max_tokens, slo, record.tpot_slo_s)
    model, warm = fallbacks.choose(
        req.models,
        nodes,
        time.time(),
        node_timeout_s=node_timeout_s,
        max_active_per_instance=max_active_per_instance,
        demands=demands,
        profiles=profiles,
    )
    return ModelChosen(model=model, warm=warm)


async def read_back_starts(registry: Registry, perf: PerfBook) -> int:
    """The load-time model from the cold-start log (`/admin/coldstarts`), oldest first, so that
    a restarted scheduler predicts starts as the one before it did; how many were read."""
    records = {r.name: r for r in await registry.all()}
    read = 0
    for event in reversed(await registry.cold_starts(200)):
        record = records.get(event.model)
        if record is not None and event.source != "resident":
            p = event.phases
            perf.start(
                record.artifact.artifact_id,
                p.load_s + p.profile_s,
                spawn_s=p.init_s,
                weight_bytes=record.artifact.weight_bytes,
            )
            read += 1
    return read

"""Scheduler bus handlers: placement, cold starts (one per model at a time), keep-alive."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time

import msgspec
from nats.aio.msg import Msg
from prometheus_client import Counter, Gauge

from policy import cold_budget, defrag, keep_warm, scheduling
from policy.backoff import Backoff, Change
from policy.perf_book import PerfBook
from policy.placement import Demand, Profile, validate
from policy.scheduling import AwaitStart, NodeView, NoRoom, StartOn, StartUnderWay, UseNode
from policy.slo import ttft_slo
from services.scheduler import routing
from services.scheduler.casts import Casts
from services.scheduler.line import Line
from services.scheduler.settings import SchedulerSettings
from services.scheduler.warm import KeepWarm
from shared import subjects
from shared.bus import Bus, decode
from shared.errors import TesseraError
from shared.messages import (
    ClusterStatus,
    ColdStartRecorded,
    ErrorCode,
    InstanceReady,
    InstanceStopped,
    InstanceView,
    ModelRecord,
    NodeStatus,
    PreemptInstance,
    Rejected,
    RelocateAnswer,
    RelocateQuery,
    ScaledOut,
    ScaleOut,
    StartInstance,
    StopInstance,
)
from shared.registry import Registry
from shared.routing_messages import ChooseModel, Placement, PlaceRequest

log = logging.getLogger(__name__)

PLACEMENTS = Counter("tessera_scheduler_placements_total", "Placement decisions", ["outcome"])
LIVE_NODES = Gauge("tessera_scheduler_live_nodes", "Engine nodes with a fresh heartbeat")
SCALE_INS = Counter("tessera_scheduler_scale_to_zero_total", "Instances unloaded after keep-alive")
PROFILED = Gauge("tessera_scheduler_profiled_models", "Registered models with a fitted performance model")
PREEMPTION_ORDERS = Counter(
    "tessera_scheduler_preemptions_total",
    "Instances preempted so that a bigger neighbour could take a request (LLM-Mesh §7.1)",
)
KEEPALIVE_BACKOFF_CAP_S = 5.0
"""Longest wait between keep-alive passes while they fail (Valkey down)."""
LINE_WAITING = Gauge(
    "tessera_scheduler_line_waiting", "Requests waiting for room: no node takes them yet within the SLOs"
)
SCALE_OUTS = Counter(
    "tessera_scheduler_scale_outs_total", "Starts of a model already running elsewhere (no instance validated)"
)


class SchedulerService:
    def __init__(self, settings: SchedulerSettings, bus: Bus, registry: Registry) -> None:
        self.settings = settings
        self.bus = bus
        self.registry = registry
        self.nodes: dict[str, NodeView] = {}
        self._casts = Casts(bus, settings, self.nodes, self._pipelined)
        # A heartbeat sent before our own last change of a node's view is stale: skip it.
        self._changed_at: dict[str, float] = {}
        self._last_placed: dict[tuple[str, str], float] = {}
        self._placed: dict[tuple[str, str], list[tuple[float, int]]] = {}
        """When each request was placed on an instance, and its prompt's tokens."""
        """When requests were placed on (node, model): counted until a heartbeat covers them."""
        self._starts: dict[tuple[str, str], tuple[StartUnderWay, asyncio.Task[InstanceReady | Rejected]]] = {}
        """(model, node) → the start under way there: a burst may start a model on several nodes at once."""
        self._keepalive: asyncio.Task[None] | None = None
        self.perf = PerfBook()
        self.line = Line()
        self._records: dict[str, ModelRecord] = {}
        """Registered models as the last keep-alive pass read them (SLOs of the neighbours),
        each pinned as its pinned adapters keep it."""
        self.warm = KeepWarm(settings, bus, self.perf, self._warm_start)

    async def start(self) -> None:
        try:  # the load-time model of the scheduler before this one (cold-start budgets)
            log.info("read %d cold starts back", await routing.read_back_starts(self.registry, self.perf))
        except Exception:
            log.exception("could not read the cold-start log: start predictions begin afresh")
        await self.bus.subscribe(subjects.place(), self.on_place, queue=subjects.SCHEDULER_QUEUE)
        await self.bus.subscribe(subjects.choose_model(), self.on_choose, queue=subjects.SCHEDULER_QUEUE)
        await self.bus.subscribe(subjects.cluster_status(), self.on_status, queue=subjects.SCHEDULER_QUEUE)
        await self.bus.subscribe(subjects.scale_out(), self.on_scale_out, queue=subjects.SCHEDULER_QUEUE)
        await self.bus.subscribe(subjects.relocatable(), self.on_relocatable, queue=subjects.SCHEDULER_QUEUE)
        await self.bus.subscribe(subjects.node_heartbeat(), self.on_heartbeat)
        await self.bus.subscribe(subjects.cold_start_recorded(), self.on_cold_start, queue=subjects.SCHEDULER_QUEUE)
        self._keepalive = asyncio.create_task(self._keepalive_loop())

    async def close(self) -> None:
        if self._keepalive:
            self._keepalive.cancel()

    # --- cluster view -------------------------------------------------------------------------

    async def on_heartbeat(self, msg: Msg) -> None:
        status = decode(msg.data, NodeStatus)
        for report in status.perf:
            self.perf.report(status.node_id, status.kind, report)
        if status.perf:
            PROFILED.set(len(self._profiles()))
        if status.sent_at < self._changed_at.get(status.node_id, 0.0):
            return
        self.nodes[status.node_id] = NodeView.from_status(status)
        LIVE_NODES.set(len(scheduling.live_nodes(self.nodes.values(), time.time(), self.settings.node_timeout_s)))
        if len(self.line):
            self.line.serve(self._decide_safely)  # requests ended there: their room may take the line's
            LINE_WAITING.set(len(self.line))

    def _set_instance(self, node_id: str, model: str, inst: InstanceView | None) -> None:
        now = time.time()
        old = self.nodes.get(node_id, NodeView(node_id=node_id, seen_at=now))
        instances = dict(old.instances)
        if inst is None:
            instances.pop(model, None)
        else:
            instances[model] = inst
        self.nodes[node_id] = dataclasses.replace(old, instances=instances, starting=old.starting - {model})
        self._changed_at[node_id] = now

    def _stopped(self, reply: InstanceStopped) -> None:
        """An instance the scheduler stopped is gone from its view at once, and what its node
        holds resident after the stop (its weights, where the pool kept them) is in it too:
        the node's heartbeats sent before this change are ignored."""
        self._set_instance(reply.node_id, reply.model, None)
        if reply.resident is not None:
            view = self.nodes[reply.node_id]
            self.nodes[reply.node_id] = dataclasses.replace(view, resident=frozenset(reply.resident))

    async def on_status(self, msg: Msg) -> None:
        now = time.time()
        live = scheduling.live_nodes(self.nodes.values(), now, self.settings.node_timeout_s)
        await self.bus.reply(
            msg,
            ClusterStatus(
                nodes=tuple(
                    NodeStatus(
                        node_id=n.node_id,
                        sent_at=n.seen_at,
                        instances=tuple(n.instances.values()),
                        starting=tuple(n.starting),
                        memory_budget_bytes=n.memory_budget_bytes,
                        memory_used_bytes=n.memory_used_bytes,
                        kind=n.kind,
                        resident=tuple(sorted(n.resident)),
                        reusable=tuple(sorted(n.reusable.items())),
                        core_build_s=n.core_build_s,
                        prewarmed=n.prewarmed,
                        kv_on_demand=n.kv_on_demand,
                    )
                    for n in sorted(live, key=lambda n: n.node_id)
                ),
                starting=tuple(sorted({m for m, _ in self._starts})),
            ),
        )

    async def on_cold_start(self, msg: Msg) -> None:
        event = decode(msg.data, ColdStartRecorded)
        record = self._records.get(event.model)
        if record is not None and event.source != "resident":
            # Until the instance is ready: placement adds the prefill (and the first token of a
            # start ordered ahead of demand comes whenever its first request does).
            p = event.phases
            aid, size = record.artifact.artifact_id, record.artifact.weight_bytes
            self.perf.start(aid, p.load_s + p.profile_s, spawn_s=p.init_s, weight_bytes=size)
        await self.registry.record_cold_start(event)

    async def on_scale_out(self, msg: Msg) -> None:
        try:
            reply: ScaledOut | Rejected = await self.scale_out(decode(msg.data, ScaleOut))
        except TesseraError as e:
            reply = Rejected(code=e.code, message=e.message, retry_after_s=e.retry_after_s)
        except Exception as e:  # the operator gets an answer, whatever happened
            log.exception("scale-out failed")
            reply = Rejected(code=ErrorCode.UNAVAILABLE, message=f"scale-out failed: {e}", retry_after_s=1.0)
        await self.bus.reply(msg, reply)

    async def scale_out(self, req: ScaleOut) -> ScaledOut | Rejected:
        """Start `req.model` on the nodes that make `req.instances` in all (not waiting for
        them: the cluster's status shows them come up), in one multicast group."""
        if req.instances < 1:
            return Rejected(code=ErrorCode.INVALID_REQUEST, message="instances must be at least 1")
        record = await self.registry.get(req.model)
        if record is None:
            return Rejected(code=ErrorCode.MODEL_NOT_FOUND, message=f"model {req.model!r} does not exist")
        self._records[record.name] = record = self.warm.pinned(record)
        now = time.time()
        view = scheduling.with_starts(
            scheduling.live_nodes(self._view(now), now, self.settings.node_timeout_s),
            ((m, s.node_id) for (m, _), (s, _) in self._starts.items()),
        )
        have = tuple(sorted(n.node_id for n in view if req.model in n.instances or req.model in n.starting))
        targets = scheduling.scale_out_nodes(req.model, view, self._profiles(), req.instances)
        if targets:
            log.info("scale-out of %s to %s, asked for", req.model, ", ".join(targets), extra={"model": req.model})
            if have:
                SCALE_OUTS.inc(len(targets))
            await self._begin_starts(record, targets)
        return ScaledOut(model=record.name, running=have, started=tuple(targets))

    # --- placement ----------------------------------------------------------------------------

    async def on_place(self, msg: Msg) -> None:
        req = decode(msg.data, PlaceRequest)
        try:
            reply = await self.place(req)
        except TesseraError as e:
            reply = Rejected(code=e.code, message=e.message, retry_after_s=e.retry_after_s)
        PLACEMENTS.labels(type(reply).__name__).inc()
        await self.bus.reply(msg, reply)

    async def on_choose(self, msg: Msg) -> None:
        """Which of an alias's members serves a request (`routing.choose`); an unexpected
        error is answered by the bus (`Bus.subscribe`)."""
        reply = await routing.choose(
            decode(msg.data, ChooseModel),
            self.registry,
            self._view(time.time()),
            self._profiles(),
            node_timeout_s=self.settings.node_timeout_s,
            max_active_per_instance=self.settings.max_active_per_instance,
        )
        await self.bus.reply(msg, reply)

    def _profiles(self) -> dict[str, Profile]:
        return self.perf.profiles(self._records.values(), kv_min_tokens=self.settings.kv_min_tokens)

    async def on_relocatable(self, msg: Msg) -> None:
        """§7.1: an engine about to preempt these instances asks whether their requests
        validate on another node (a join or a new instance there)."""
        req = decode(msg.data, RelocateQuery)
        now = time.time()
        others = [
            n
            for n in scheduling.live_nodes(self._view(now), now, self.settings.node_timeout_s)
            if n.node_id != req.node_id
        ]
        profiles = self._profiles()

        def validates(node: NodeView, model: str) -> bool:
            return scheduling.relocatable(model, [node], profiles)

        await self.bus.reply(msg, RelocateAnswer(relocatable=defrag.relocatable(req.models, others, validates)))

    async def place(self, req: PlaceRequest) -> Placement | Rejected:
        record = await self.registry.get(req.model)
        if record is None:
            return Rejected(code=ErrorCode.MODEL_NOT_FOUND, message=f"model {req.model!r} does not exist")
        if req.not_on:
            self._set_instance(req.not_on, req.model, None)
        self._records[record.name] = record = self.warm.pinned(record)
        decision = self._decide(req)
        if isinstance(decision, NoRoom):
            # No node takes it yet without breaking the SLOs of requests already there: wait
            # for their room (woken by heartbeats), as long as the gateway and admission allow.
            wait_s = req.wait_s
            if self.settings.reject_over_slo is not None:
                wait_s = min(wait_s, self.settings.reject_over_slo * ttft_slo(record, req.prompt_tokens))
            placed = await self.line.wait(req, wait_s) if wait_s > 0 else None
            LINE_WAITING.set(len(self.line))
            if placed is None:  # its wait is over: as things stand now, else what no room means
                placed = self._decide(req) if wait_s > 0 else decision
                if isinstance(placed, NoRoom):
                    placed = placed.otherwise
                    if isinstance(placed, UseNode):
                        self._note_placed(placed.node_id, req)
            decision = placed
        assert not isinstance(decision, NoRoom)  # the line hands out only the others
        return await self._carry_out(req, record, decision)

    def _decide_safely(self, req: PlaceRequest) -> scheduling.Decision:
        """`_decide` for a request in line: whatever goes wrong is that request's answer, not
        the heartbeat handler's (the line behind it keeps moving)."""
        try:
            return self._decide(req)
        except Exception as e:
            log.exception("placement of %s failed", req.request_id)
            return Rejected(code=ErrorCode.UNAVAILABLE, message=f"placement failed: {e}", retry_after_s=1.0)

    def _decide(self, req: PlaceRequest) -> scheduling.Decision:
        """Placement on the current view; a request sent to a running instance is counted
        there at once (`_placed`), so the next decision sees it."""
        record = self._records.get(req.model)
        if record is None:  # deregistered while it waited
            return Rejected(code=ErrorCode.MODEL_NOT_FOUND, message=f"model {req.model!r} does not exist")
        view = self._view(time.time())
        if req.avoid and any(n.node_id != req.avoid for n in view):
            view = [n for n in view if n.node_id != req.avoid]  # it was preempted there
        # Its TTFT SLO grows with its prompt (LLM-Mesh §8.1): a long prompt is not late for
        # taking the prefill it needs, and does not scale the model out for that alone.
        demand = Demand(req.prompt_tokens, req.max_tokens, ttft_slo(record, req.prompt_tokens), record.tpot_slo_s)
        profiles = self._profiles()
        decision = scheduling.place(
            req.model,
            view,
            self._starts_by_model(),
            time.time(),
            node_timeout_s=self.settings.node_timeout_s,
            max_active_per_instance=self.settings.max_active_per_instance,
            demand=demand,
            profiles=profiles,
            exclusive=self.settings.placement == "exclusive",
            reject_over_slo=self.settings.reject_over_slo,
            priorities={m: r.priority for m, r in self._records.items() if r.priority},
            pinned=frozenset(m for m, r in self._records.items() if r.min_instances > 0),
        )
        if log.isEnabledFor(logging.DEBUG):
            at = next((n for n in view if isinstance(decision, UseNode) and n.node_id == decision.node_id), None)
            log.debug(
                "placed %s (%d prompt tokens): %r, predicted %s (%s)",
                req.request_id,
                req.prompt_tokens,
                decision,
                validate(at, req.model, demand, profiles) if at and req.model in profiles else None,
                at.instances.get(req.model) if at else None,
                extra={"model": req.model},
            )
        if isinstance(decision, UseNode):
            self._note_placed(decision.node_id, req)
        return decision

    def _note_placed(self, node_id: str, req: PlaceRequest) -> None:
        self._last_placed[(node_id, req.model)] = time.time()
        self._placed.setdefault((node_id, req.model), []).append((time.time(), req.prompt_tokens))

    async def _carry_out(
        self, req: PlaceRequest, record: ModelRecord, decision: scheduling.Decision
    ) -> Placement | Rejected:
        if isinstance(decision, StartOn) and any(req.model in n.instances for n in self.nodes.values()):
            SCALE_OUTS.inc()
            log.info(
                "scale-out of %s to %s: no running instance validates (%s)",
                req.model,
                decision.node_id,
                decision.why or "none measured",
                extra={"model": req.model},
            )
        if (
            isinstance(decision, UseNode)
            and decision.scale_out_to
            and (req.model, decision.scale_out_to) not in self._starts
        ):
            SCALE_OUTS.inc()
            log.info(
                "scale-out of %s to %s for the requests to come, this one queues on %s: no running "
                "instance validates (%s)",
                req.model,
                decision.scale_out_to,
                decision.node_id,
                decision.why,
                extra={"model": req.model},
            )
            self._begin_start(record, decision.scale_out_to)  # no request waits for it
        if isinstance(decision, UseNode) and decision.preempt:
            await self._preempt(decision.node_id, decision.preempt, req.model, decision.why)
        match decision:
            case UseNode(node_id):
                return Placement(request_id=req.request_id, node_id=node_id, cold_start=False)
            case AwaitStart(node_id) | StartOn(node_id):
                if (refused := self._over_budget(req, record, node_id)) is not None:
                    self._begin_start(record, node_id)  # the start goes ahead: the retry finds it warm
                    live = scheduling.live_nodes(self._view(time.time()), time.time(), self.settings.node_timeout_s)
                    warm = cold_budget.warm_instead(req.model, live, self.settings.max_active_per_instance)
                    if warm is None:
                        return refused
                    self._note_placed(warm, req)  # late on a running instance rather than cold
                    return Placement(request_id=req.request_id, node_id=warm, cold_start=False)
                ready = await self._ensure_started(record, node_id)
                if isinstance(ready, Rejected):
                    return ready
                self._note_placed(ready.node_id, req)
                p = ready.phases
                return Placement(
                    request_id=req.request_id,
                    node_id=ready.node_id,
                    cold_start=True,
                    start_source=ready.source,
                    start_s=p.init_s + p.load_s + p.profile_s,
                )
            case Rejected():
                log.debug("refused %s: %s", req.request_id, decision.message, extra={"model": req.model})
                return decision
        raise AssertionError(decision)

    def _over_budget(self, req: PlaceRequest, record: ModelRecord, node_id: str) -> Rejected | None:
        now = time.time()
        node = next((n for n in self._view(now) if n.node_id == node_id), None)
        under_way = self._starts.get((record.name, node_id))
        profile = self._profiles().get(record.name)
        start = under_way[0] if under_way is not None else None
        guess = self.settings.start_guess_s
        return routing.over_budget(req, record, node, start, self.perf, profile, guess, now)

    async def _preempt(self, node_id: str, victims: tuple[str, ...], for_model: str, why: str) -> None:
        """Order the engine to preempt `victims` for `for_model` (LLM-Mesh §7.1); their
        requests come back through the gateway, which places them elsewhere."""
        for victim in victims:
            log.info("preempting %s on %s for %s: %s", victim, node_id, for_model, why, extra={"model": victim})
            try:
                reply = await self.bus.request(
                    subjects.engine_preempt(node_id),
                    PreemptInstance(model=victim, for_model=for_model),
                    InstanceStopped,
                    timeout=self.settings.request_timeout_s,
                )
            except TesseraError as e:
                log.warning("preemption of %s on %s failed: %s", victim, node_id, e.message)
                continue
            if reply.stopped:
                PREEMPTION_ORDERS.inc()
                self._set_instance(node_id, victim, None)

    def _view(self, now: float) -> list[NodeView]:
        """The heartbeats' view plus the placements made since each was sent: requests
        placed a moment ago are queued on their instance even if no heartbeat says so yet;
        and the starts this scheduler has under way there (placement is told only the latest
        start of each model)."""
        out = []
        for n in scheduling.with_starts(self.nodes.values(), self._starts):
            extra: dict[str, tuple[int, int]] = {}
            for model in n.instances:
                placed = self._placed.get((n.node_id, model), [])
                # Placed before the heartbeat was sent: the heartbeat counts it (or it is over).
                # One placed a moment earlier may not have reached the engine yet and is then
                # counted by neither, briefly; counting it twice would refuse requests.
                placed[:] = [(t, n_tok) for t, n_tok in placed if t > n.seen_at and t > now - 60]
                if placed:
                    # Queued there with their prompts: a continuous-batching engine prefills
                    # them ahead of the next request (a burst arrives between two heartbeats).
                    extra[model] = (len(placed), sum(n_tok for _, n_tok in placed))
            if extra:
                instances = {
                    m: (
                        msgspec.structs.replace(
                            i, active=i.active + extra[m][0], queued_tokens=i.queued_tokens + extra[m][1]
                        )
                        if m in extra
                        else i
                    )
                    for m, i in n.instances.items()
                }
                n = dataclasses.replace(n, instances=instances)
            out.append(n)
        return out

    def _starts_by_model(self) -> dict[str, StartUnderWay]:
        """The start under way per model for placement: the latest, where a model has several."""
        out: dict[str, StartUnderWay] = {}
        for (model, _), (start, _) in self._starts.items():
            if model not in out or start.since > out[model].since:
                out[model] = start
        return out

    async def _begin_starts(self, record: ModelRecord, node_ids: list[str]) -> None:
        """Start the model on several nodes at once, its blob brought to all of them along one
        PipeCast plan (each target forwards blocks to the next while it receives them)."""
        if self.settings.multicast_scale_out:
            await self._casts.to(record, node_ids)
        for node_id in node_ids:
            self._begin_start(record, node_id, multicast=False)

    def _begin_start(self, record: ModelRecord, node_id: str, multicast: bool = True) -> None:
        """Start the model there unless a start of it is under way (one per model at a time);
        `_starts` holds the task until it is done. `multicast`: the start orders its own blob
        from the nodes running the model (False: the caller ordered it for a group)."""
        key = (record.name, node_id)
        if key not in self._starts:
            task = asyncio.create_task(self._start(record, node_id, multicast))
            self._starts[key] = (StartUnderWay(node_id, time.time()), task)
            task.add_done_callback(lambda _: self._starts.pop(key, None))

    def _warm_start(self, record: ModelRecord, node_id: str) -> asyncio.Task[InstanceReady | Rejected]:
        self._begin_start(record, node_id)
        return self._starts[(record.name, node_id)][1]

    async def _ensure_started(self, record: ModelRecord, node_id: str) -> InstanceReady | Rejected:
        """Every request that needs the model while it starts waits for the same start."""
        self._begin_start(record, node_id)
        key = (record.name, node_id)
        start, task = self._starts[key]
        self._starts[key] = (dataclasses.replace(start, waiting=start.waiting + 1), task)
        try:
            return await asyncio.shield(task)
        finally:
            if key in self._starts and self._starts[key][1] is task:
                s, _ = self._starts[key]
                self._starts[key] = (dataclasses.replace(s, waiting=max(0, s.waiting - 1)), task)

    async def _start(self, record: ModelRecord, node_id: str, multicast: bool = True) -> InstanceReady | Rejected:
        log.info("cold start of %s on %s", record.name, node_id, extra={"model": record.name})
        if multicast and self.settings.multicast_scale_out:
            await self._casts.grouped(record, node_id)
        view = self.nodes.get(node_id)
        resident = view is not None and record.artifact.artifact_id in view.resident
        try:
            ready = await self.bus.request(
                subjects.engine_start(node_id),
                StartInstance(model=record),
                InstanceReady | Rejected,
                timeout=self.settings.start_timeout_s,
            )
        except TesseraError as e:
            return Rejected(code=e.code, message=e.message, retry_after_s=e.retry_after_s)
        if isinstance(ready, InstanceReady):
            if not ready.source:  # an engine that does not say: the view's guess
                ready = msgspec.structs.replace(ready, source="resident" if resident else "load")
            now = time.time()
            self._set_instance(
                node_id,
                record.name,
                InstanceView(model=record.name, active=0, last_used=now, loaded_at=now),
            )
            self.warm.started(record, node_id)
        return ready

    def _pipelined(self, node_id: str, model: str) -> None:
        """A scale-out's pipeline serves `model` from `node_id`: it counts as running it there."""
        view = self.nodes.get(node_id)
        if view is None or model not in view.instances:  # its heartbeat may have said so first
            now = time.time()
            self._set_instance(node_id, model, InstanceView(model=model, active=0, last_used=now, loaded_at=now))

    # --- keep-alive ---------------------------------------------------------------------------

    async def _keepalive_loop(self) -> None:
        # While Valkey is down every pass fails: back off (up to KEEPALIVE_BACKOFF_CAP_S) and
        # log when it goes down and when it comes back, not a traceback every pass.
        backoff = Backoff(self.settings.keep_alive_check_s, cap_s=KEEPALIVE_BACKOFF_CAP_S)
        while True:
            error: Exception | None = None
            try:
                await self.scale_in_idle()
                now = time.time()
                live = scheduling.live_nodes(self._view(now), now, self.settings.node_timeout_s)
                self.warm.run(self._records, live, set(self._starts))
            except Exception as e:
                error = e
            step = backoff.step(error is None, time.monotonic())
            if step.change == Change.DOWN:
                log.warning(
                    "keep-alive passes fail (%s: %s); retrying with backoff up to %gs, logging again once they work",
                    type(error).__name__,
                    error,
                    KEEPALIVE_BACKOFF_CAP_S,
                    exc_info=error,
                )
            elif step.change == Change.UP:
                log.info("keep-alive passes work again, after %d failures in %.1fs", step.failures, step.down_s)
            await asyncio.sleep(step.delay_s)

    async def scale_in_idle(self) -> None:
        models = await self.registry.all()
        self.warm.adapter_pins = [a for a in await self.registry.adapters() if a.min_instances > 0 or a.priority > 0]
        records = keep_warm.with_adapter_pins(models, self.warm.adapter_pins)
        self._records = {r.name: r for r in records}
        keep = {r.name: r.keep_alive_s for r in records}
        floors = {r.name: r.min_instances for r in records if r.min_instances > 0}
        now = time.time()
        live = scheduling.live_nodes(self.nodes.values(), now, self.settings.node_timeout_s)
        for order in scheduling.idle_instances(live, keep, self._last_placed, now, floors):
            if (order.model, order.node_id) in self._starts:
                continue
            try:
                reply = await self.bus.request(
                    subjects.engine_stop(order.node_id),
                    StopInstance(model=order.model, idle_since=order.idle_since),
                    InstanceStopped,
                    timeout=self.settings.request_timeout_s,
                )
            except TesseraError as e:
                log.warning("stop of %s on %s failed: %s", order.model, order.node_id, e.message)
                continue
            if reply.stopped or reply.reason == "not loaded":
                self._stopped(reply)
                self._last_placed.pop((order.node_id, order.model), None)
            if reply.stopped:
                SCALE_INS.inc()
                log.info("scaled %s to zero on %s", order.model, order.node_id, extra={"model": order.model})

"""One instance's KV cache as the memory manager sees it: sized by LLM-Mesh's watermark rule
(§6.2, `policy/kv_watermark.py`) from the requests it is running.

The OpenVINO runtime allocates the cache on demand as rows grow, so what this sizes is the
reservation: the bytes the node's reservation station counts against its budget for
`<name>:kv`. It starts at the floor (eq. 2 with nothing running: L_min tokens), grows early
when a request would not fit (straight to the recommended size, or to the requirement when
only that fits, §6.4), and shrinks lazily once requests have ended.

Pure: the engine feeds it requests and answers and issues the resizes it plans.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from policy.headroom import headroom
from policy.kv_watermark import (
    Action,
    KvPlan,
    on_admit,
    on_complete,
    required_bytes,
)


@dataclass
class _Request:
    input_tokens: int
    cap: int
    """Most tokens it may generate (its max_tokens, or what the context leaves)."""
    generated: int = 0
    received_at: float = 0.0
    ttft_slo_s: float | None = None
    """Its own TTFT SLO (it grows with the prompt: `policy/slo.py`); None: the model's."""
    """ST of eq. 1 (the engine's clock)."""


@dataclass
class KvAccount:
    per_token_bytes: int
    min_tokens: int
    """L_min of eq. 2 (LLM-Mesh sets it to the model's maximum sequence length)."""
    watermark: float
    reserved_bytes: int = 0
    """What the reservation station holds for this cache now."""
    mean_output: float = 0.0
    """Ō: the mean output length of the requests this instance has completed."""
    completed: int = 0
    running: dict[str, _Request] = field(default_factory=dict)

    def required(self) -> int:
        """Eq. 2 over the running requests."""
        return required_bytes(
            self.per_token_bytes,
            ((r.input_tokens, r.generated, r.cap) for r in self.running.values()),
            self.mean_output,
            self.min_tokens,
        )

    @property
    def reserved_tokens(self) -> int:
        return self.reserved_bytes // self.per_token_bytes if self.per_token_bytes else 0

    def admit(
        self,
        request_id: str,
        input_tokens: int,
        cap: int,
        available: int,
        received_at: float = 0.0,
        ttft_slo_s: float | None = None,
    ) -> KvPlan:
        """Count a request in and plan the cache for it (`available`: bytes the node could
        still grant). The request stays counted whatever the plan: the caller removes it
        with `forget` if it cannot run."""
        self.running[request_id] = _Request(input_tokens, max(cap, 0), received_at=received_at, ttft_slo_s=ttft_slo_s)
        return on_admit(self.reserved_bytes, self.required(), available, self.watermark)

    def progress(self, request_id: str, generated: int, available: int) -> KvPlan:
        """A running request has `generated` tokens: past the mean it needs more than the
        optimistic estimate reserved (§6.4's underestimate). KEEP while it still fits."""
        r = self.running.get(request_id)
        if r is not None:
            r.generated = generated
        required = self.required()
        if required <= self.reserved_bytes:
            return KvPlan(Action.KEEP, self.reserved_bytes)
        return on_admit(self.reserved_bytes, required, available, self.watermark)

    def complete(self, request_id: str, generated: int, finished: bool = True, held: int = 0) -> KvPlan:
        """A request ended after `generated` tokens: it updates Ō (unless it did not finish on
        its own: a cancel or an error says nothing of output lengths) and may let the cache
        shrink, not below `held` (what the engine's cache keeps allocated for this instance)."""
        if self.running.pop(request_id, None) is not None and finished:
            self.completed += 1
            self.mean_output += (generated - self.mean_output) / self.completed
        return on_complete(self.reserved_bytes, self.required(), self.watermark, held)

    def evictee(self, ttft_slo_s: float, tpot_slo_s: float, now: float) -> str | None:
        """§6.4: the cache outgrew its reservation and the node cannot grant even the
        requirement: the request with the most headroom (eq. 1) leaves, to go on elsewhere,
        so that the others fit. None with fewer than two requests: evicting the only one
        frees nothing for anyone here (it runs on, over the optimistic budget, as §6.4's
        last resort)."""
        if len(self.running) < 2:
            return None

        def room(rid: str) -> float:
            r = self.running[rid]
            own = ttft_slo_s if r.ttft_slo_s is None else r.ttft_slo_s
            return headroom(r.received_at, own, tpot_slo_s, r.generated, now)

        return max(self.running, key=room)

    def forget(self, request_id: str) -> None:
        """A request that never ran (refused): no trace in Ō."""
        self.running.pop(request_id, None)

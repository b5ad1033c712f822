"""Headroom, the urgency of a request (LLM-Mesh §5.1, eq. 1):

    headroom = ST + TTFT_SLO + TPOT_SLO · O − CT,

the longest the request's next token may still be delayed without missing its SLO; a
negative headroom is a missed SLO. A node runs one iteration of one instance at a time and
gives the next to the instance holding the least headroom: the engine's gate
(`services/engine/step_gate.py`) does that with each worker's deadline (headroom + now). The
KV account (`kv_account.py`) evicts the request with the most headroom when a cache cannot
grow (§6.4).

Pure: a request's clock in, a number out.
"""

from __future__ import annotations


def headroom(start: float, ttft_slo: float, tpot_slo: float, generated: int, now: float) -> float:
    """Eq. 1: seconds the request's next token may still wait (negative: SLO already missed)."""
    return start + ttft_slo + tpot_slo * generated - now

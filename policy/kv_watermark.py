"""How big an instance's KV cache should be (LLM-Mesh §6.1, §6.2, §6.4).

Eq. 2 sizes the cache optimistically, assuming each request ends at the mean output length
Ō seen so far, with a floor of L_min tokens so a quiet instance can still take one long
request:

    M_require = C · max(Σ_r (I_r + max(O_r, Ō)), L_min)

Resizing a paged KV cache copies it (Fig. 8: 32→64 GB took 1.9 s, 32→16 GB 0.3 s), so the
cache grows early and shrinks late: it grows straight to M_recommend = M_require · (1 + w)
when it is short, and shrinks to M_recommend only once M_recommend · (1 + w) < M_cur.
If growing to M_recommend does not fit, it compromises (§6.4): M_require is enough to accept
the request.

Pure: numbers in, a plan out.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum

DEFAULT_WATERMARK = 0.2
"""w: 20% headroom over the requirement; LLM-Mesh leaves w a hyper-parameter."""


def floor_tokens(min_tokens: int, context_length: int, on_demand: bool = False) -> int:
    """L_min for a model: the setting (`TESSERA_KV_MIN_TOKENS`) within its context. 0 means the
    context itself, as the paper sets it, where growing the cache copies it (the floor buys a
    long request without a resize); where the engine's cache grows as its rows fill
    (`on_demand`: OpenVINO GenAI's dynamic cache) a resize is only the reservation's, and 0
    means no floor: eq. 2 counts the requests alone."""
    if min_tokens > 0:
        return min(min_tokens, context_length)
    return 0 if on_demand else context_length


def required_bytes(
    per_token_bytes: int,
    requests: Iterable[tuple[int, int] | tuple[int, int, int]],
    mean_output: float,
    min_tokens: int,
) -> int:
    """Eq. 2 over (input_len, generated) of each running request. A third element, where
    given, caps the request's output (its `max_tokens`): it can never hold more than that,
    whatever the mean says."""
    tokens = 0.0
    for r in requests:
        i, o = r[0], r[1]
        out = max(o, mean_output)
        tokens += i + (min(out, max(r[2], o)) if len(r) > 2 else out)
    return math.ceil(per_token_bytes * max(tokens, min_tokens))


def recommended_bytes(required: int, watermark: float = DEFAULT_WATERMARK) -> int:
    return math.ceil(required * (1.0 + watermark))


class Action(StrEnum):
    KEEP = "keep"
    GROW = "grow"
    GROW_COMPROMISED = "grow_compromised"
    SHRINK = "shrink"
    REFUSE = "refuse"


@dataclass(frozen=True)
class KvPlan:
    action: Action
    target_bytes: int
    """The cache size to resize to (the current size for KEEP and REFUSE)."""

    @property
    def accepts(self) -> bool:
        return self.action is not Action.REFUSE


def on_admit(current: int, required: int, available: int, watermark: float = DEFAULT_WATERMARK) -> KvPlan:
    """The cache plan when a request joins: `required` is eq. 2 with the request counted,
    `available` the bytes the node could still grant (its optimistic budget headroom)."""
    if current >= required:
        return KvPlan(Action.KEEP, current)
    recommended = recommended_bytes(required, watermark)
    if recommended - current <= available:
        return KvPlan(Action.GROW, recommended)
    if required - current <= available:
        return KvPlan(Action.GROW_COMPROMISED, required)
    return KvPlan(Action.REFUSE, current)


def on_complete(current: int, required: int, watermark: float = DEFAULT_WATERMARK, held: int = 0) -> KvPlan:
    """The cache plan when a request leaves: shrink only below the watermark (lazy), and never
    below `held`, what the engine's cache keeps allocated whatever runs in it (OpenVINO GenAI's
    grows and never frees: a smaller reservation would only undercount the process, and the
    next burst's admissions would each grow it back through the memory manager)."""
    recommended = max(recommended_bytes(required, watermark), held)
    if recommended * (1.0 + watermark) < current:
        return KvPlan(Action.SHRINK, recommended)
    return KvPlan(Action.KEEP, current)


def resize_seconds(old_bytes: int, new_bytes: int, copy_bps: float, fixed_s: float) -> float:
    """Time of a paged-KV resize: allocate new blocks and copy the live ones (Fig. 7).

    The copy moves min(old, new) bytes and allocation touches the new size; calibrated
    defaults in the simulator put 32→64 GB near Fig. 8's 1.9 s.
    """
    if new_bytes == old_bytes:
        return 0.0
    return fixed_s + (min(old_bytes, new_bytes) + max(new_bytes - old_bytes, 0)) / copy_bps

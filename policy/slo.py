"""A request's TTFT SLO, which grows with its prompt (LLM-Mesh §3.1 and §8.1).

The paper sets the TTFT SLO of a request of L input tokens to max(2, L / 512) s: a floor for
short prompts, and for long ones a budget proportional to the prefill they need (a fixed SLO
makes every long prompt look late, and the scheduler scales out for prompts that are merely
long). A registration carries both terms: `ttft_slo_s`, the floor (2 s in the paper), and
`ttft_slo_per_token_s`, the allowance per prompt token (1/512 s in the paper, the default;
0 keeps the SLO fixed). The two are combined as the paper does, by the larger, not summed:
the floor already covers the prefill of a short prompt, and a sum would give every prompt
L / 512 s more than the paper does.

The scheduler (shadow validation, its early reject), the gateway (how long a request may wait
in line) and the simulator all take a request's SLO from here, so they judge it alike.

Pure: numbers in, seconds out.
"""

from __future__ import annotations

from typing import Protocol


class TtftTarget(Protocol):
    """What carries a model's TTFT SLO terms (`shared.messages.ModelRecord`,
    `policy.placement.Profile`)."""

    @property
    def ttft_slo_s(self) -> float: ...
    @property
    def ttft_slo_per_token_s(self) -> float: ...


def ttft_slo(model: TtftTarget, prompt_tokens: int) -> float:
    """The TTFT SLO of a request of `prompt_tokens` for `model`, in seconds: max(base, L ×
    per-token), LLM-Mesh's max(2, L / 512) with its two constants the registration's."""
    return max(model.ttft_slo_s, max(prompt_tokens, 0) * model.ttft_slo_per_token_s)

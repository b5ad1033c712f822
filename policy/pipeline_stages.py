"""Which node of an execution pipeline runs which layers, and from when (FaaScale §4.2-4.3).

While a scale-out's blocks are multicast, its targets soon hold complementary parts of the
model: with k-way transmission sub-group i receives the chunks circularly shifted by i, so
the targets together hold every block after about b/k block times, long before any one of
them does. A pipeline then forms over them ("once a set of nodes collectively holds the
required blocks", §4.2): each runs the decoder layers whose tensors it holds, as one stage,
and hands the hidden states on. (Algorithm 2's static pipelines, one node of each sub-group,
`policy.multicast.pipelines`, are one such set; any set of the targets may serve.)

- A stage runs a range of units: the decoder layers, then the head (final norm and output
  head) as a unit of its own, since a tied head is the embedding, which the first stage's
  node holds early and the last layers' node late.
- `needs` is what a stage running units [lo, hi) must hold: every stage's lead blocks (the
  checkpoint's small files and weights header), its units' blocks, and the embedding for the
  stage running unit 0.
- `assign` cuts the units into as few stages as the holdings allow: from the first unit on,
  the node that can run the longest run of units from there takes it (greedy furthest reach,
  which gives the fewest stages for an interval cover; a tie keeps the nodes' order).
- `ready` walks a plan's steps to the first after which `assign` succeeds, and says whether
  that comes before any of the pipeline's nodes would hold the whole model (else it serves
  nothing a local start would not serve as soon).

Pure: a layout (block spans), holdings and a plan in; stages out.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from policy.multicast import Plan

Span = tuple[int, int]
"""Blocks [first, last], both included (as a `shared.pipeline_messages.StageLayout` gives them)."""


@dataclass(frozen=True)
class Layout:
    """Where a checkpoint's parts lie among its block set's blocks."""

    blocks: int
    lead: int
    """Blocks [0, lead): what every stage needs (small files, the weights' header)."""
    units: tuple[tuple[Span, ...], ...]
    """Each unit's blocks, in the order a forward pass runs them: the decoder layers, then
    the head (norm and output head; a tied head is the embedding, so that unit may run on a
    node other than the last layers')."""
    first: tuple[Span, ...] = ()
    """Besides its units, what the stage running unit 0 needs (the embedding)."""


@dataclass(frozen=True)
class StagePlan:
    node: str
    lo: int
    hi: int
    blocks: frozenset[int]
    """What it must hold before it starts (`needs`)."""


def _blocks(spans: Sequence[Span]) -> set[int]:
    return {b for lo, hi in spans for b in range(lo, hi + 1)}


def needs(layout: Layout, lo: int, hi: int) -> frozenset[int]:
    """The blocks a stage running units [lo, hi) needs."""
    out = set(range(layout.lead)) | {b for unit in layout.units[lo:hi] for b in _blocks(unit)}
    if lo == 0:
        out |= _blocks(layout.first)
    return frozenset(out)


def assign(layout: Layout, nodes: Sequence[str], holds: Callable[[str], frozenset[int]]) -> list[StagePlan] | None:
    """The stages of a pipeline over `nodes` (in the pipeline's order), each node holding
    `holds(node)`: contiguous unit ranges covering every unit, fewest first; None where some
    unit is held whole by none of them."""
    units = len(layout.units)
    lead = set(range(layout.lead))
    first = _blocks(layout.first)
    # What a node can run is known unit by unit: a range needs the lead, each of its units,
    # and the embedding if it starts at unit 0.
    can: dict[str, list[bool]] = {}
    for node in nodes:
        held = holds(node)
        can[node] = [lead <= held and _blocks(u) <= held for u in layout.units]
        if not first <= held:
            can[node].append(False)  # a sentinel: no range from unit 0 on this node
    out: list[StagePlan] = []
    lo = 0
    while lo < units:
        best: tuple[int, str] | None = None
        for node in nodes:
            ok = can[node]
            if lo == 0 and len(ok) > units:
                continue
            hi = lo
            while hi < units and ok[hi]:
                hi += 1
            if hi > lo and (best is None or hi > best[0]):
                best = (hi, node)
        if best is None:
            return None
        hi, node = best
        out.append(StagePlan(node, lo, hi, needs(layout, lo, hi)))
        lo = hi
    return out


@dataclass(frozen=True)
class Ready:
    step: int
    """The plan step after which the pipeline can serve."""
    stages: tuple[StagePlan, ...]
    whole_step: int
    """The step after which the first of its nodes holds the whole model."""

    @property
    def early(self) -> bool:
        """It serves before any of its nodes could alone, and needs more than one node."""
        return self.step < self.whole_step and len({s.node for s in self.stages}) > 1


def ready(plan: Plan, nodes: Sequence[str], layout: Layout, max_stages: int = 0) -> Ready | None:
    """The first step of `plan` after which `nodes` can serve as a pipeline of at most
    `max_stages` stages (0: any number; each stage is a worker on its node), and its stages;
    None where they never can (a layout that is not the plan's)."""
    if layout.blocks != plan.blocks or not nodes:
        return None
    whole = min(plan.complete_step(n) for n in nodes)
    for step in range(plan.steps):

        def holds(node: str, step: int = step) -> frozenset[int]:
            return plan.holds_after(node, step)

        stages = assign(layout, nodes, holds)
        if stages is not None and (not max_stages or len(stages) <= max_stages):
            return Ready(step, tuple(stages), whole)
    return None

"""PipeCast multicast plans (FaaScale §4.1-4.2): which node sends which block to which, when.

A scale-out to several nodes at once must not have every node read the whole model from the
store: the store's bandwidth is then shared N ways and the time grows with N. PipeCast instead
splits the nodes into k sub-groups, one per node that already holds the model (a source: the
store counts as one), and each sub-group multicasts along a binomial pipeline: every node that
holds a block forwards it while it receives the next, so that reaching L nodes takes about
b + log2(L) block times instead of L × b.

- `kway_orders` is Algorithm 1: the blocks cut into k chunks, sub-group i sending them
  circularly shifted by i chunks, so that after b/k block times the sub-groups together hold
  every block once (two nodes of different sub-groups hold complementary halves).
- `subgroups` is §4.2's split of the targets among the sources: as even as it can be.
- `binomial_sends` schedules one sub-group: in each step a node sends at most one block and
  receives at most one (a full-duplex link moves a block each way per block time). The rarest
  block in the sub-group goes first, ties broken by the sub-group's order, which is what makes
  it a pipeline: the source keeps feeding new blocks while the targets trade the ones they
  have. Ganesan & Seshadri's binomial pipeline takes the optimal b + ⌈log2 n⌉ − 1 steps for
  n = 2^d nodes; this greedy matching, for any n, took at most 7 steps more up to n = 1,025
  (a few block times; tested).
- `pipelines` is Algorithm 2: execution pipelines that serve before the last block, one node
  from each sub-group (together they hold every chunk early).
- `naive` is the baseline: every target reads every block from the store.

`transfer_s` prices a plan on links of a given bandwidth and a store of its own (the simulator
and the benchmark price both schemes with it); the loaders run the same plan for real, as a
dataflow (a node forwards a block once it has it), not in lock-step.

Pure: names, block counts and bandwidths in; a plan and times out.
"""

from __future__ import annotations

import math
import random
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

STORE = "store"
"""The model store as a source: a node name no engine node has."""


@dataclass(frozen=True)
class Send:
    """`src` sends block `block` to `dst` in step `step` (0-based)."""

    step: int
    src: str
    dst: str
    block: int


@dataclass(frozen=True)
class Plan:
    """A multicast: the sends that bring every block to every target."""

    blocks: int
    sources: tuple[str, ...]
    targets: tuple[str, ...]
    sends: tuple[Send, ...]
    groups: tuple[tuple[str, ...], ...] = ()
    """Each sub-group's targets (group i is fed by `sources[i]`)."""
    orders: tuple[tuple[int, ...], ...] = ()
    """Each sub-group's block order (Algorithm 1)."""
    _by_dst: Mapping[str, tuple[Send, ...]] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        by: dict[str, list[Send]] = defaultdict(list)
        for s in sorted(self.sends, key=lambda s: (s.step, s.block)):
            by[s.dst].append(s)
        object.__setattr__(self, "_by_dst", {d: tuple(v) for d, v in by.items()})

    @property
    def steps(self) -> int:
        return 1 + max((s.step for s in self.sends), default=-1)

    def feeds(self, dst: str) -> tuple[Send, ...]:
        """What `dst` receives, in the order it receives it."""
        return self._by_dst.get(dst, ())

    def complete_step(self, dst: str) -> int:
        """The step after which `dst` holds every block (-1: it received nothing)."""
        return max((s.step for s in self.feeds(dst)), default=-1)

    def holds_after(self, dst: str, step: int) -> frozenset[int]:
        """The blocks `dst` holds once `step` is done (a source holds them all)."""
        if dst in self.sources:
            return frozenset(range(self.blocks))
        return frozenset(s.block for s in self.feeds(dst) if s.step <= step)


def kway_orders(blocks: int, k: int, lead: int = 0) -> list[list[int]]:
    """FaaScale Algorithm 1: blocks 0..b-1 in k chunks of ⌈b/k⌉; sub-group i's order is the
    chunks circularly shifted by i (S_i, S_i+1, …, S_i-1). The first `lead` blocks (what
    every pipeline stage needs: a checkpoint's small files and header) go first in every
    order, the chunks being cut from the rest."""
    if blocks < 1 or k < 1:
        raise ValueError("a plan needs at least one block and one sub-group")
    if not 0 <= lead < blocks:
        lead = 0
    rest = blocks - lead
    size = math.ceil(rest / k)
    chunks = [list(range(lead + size * i, lead + min(size * (i + 1), rest))) for i in range(k)]
    return [[*range(lead), *(b for j in range(k) for b in chunks[(i + j) % k])] for i in range(k)]


def chunk_of(block: int, blocks: int, k: int) -> int:
    """Which of Algorithm 1's k chunks holds `block`."""
    return block // math.ceil(blocks / k)


def subgroups(sources: Sequence[str], targets: Sequence[str]) -> list[list[str]]:
    """§4.2: the targets dealt to the sources as evenly as they go (sizes differ by at most
    one, in the targets' order), one sub-group per source; none is empty unless there are
    fewer targets than sources."""
    k = len(sources)
    if k < 1:
        raise ValueError("a multicast needs a source")
    base, extra = divmod(len(targets), k)
    out: list[list[str]] = []
    at = 0
    for i in range(k):
        n = base + (1 if i < extra else 0)
        out.append(list(targets[at : at + n]))
        at += n
    return out


CANDIDATE_SENDERS = 16
"""How many senders, drawn at random among the holders (the source always among them), a
receiver looks at in a step: all of them make a step cost O(n²), so that 1,024 targets took
37 s to plan; 16 plan them in about a second, within a step of the full search."""


def binomial_sends(source: str, targets: Sequence[str], order: Sequence[int], seed: int = 0) -> list[Send]:
    """One sub-group's schedule: `source` holds every block of `order`, `targets` none.

    Each step is a matching of senders to receivers: a node sends at most one block and
    receives at most one. Receivers are served fewest-blocks-first (the ones furthest behind
    need a sender most); each takes, from a free sender among its candidates, the block
    rarest in the sub-group that it lacks, ties broken by `order`, so that new blocks keep
    entering the group while the ones already in it spread. Deterministic for a `seed`."""
    rng = random.Random(seed)
    nodes = [source, *targets]
    n, b = len(nodes), len(order)
    held = [(1 << b) - 1] + [0] * len(targets)  # bit r: the block at rank r of `order`
    count = [b] + [0] * len(targets)
    copies = [1] * b
    sends: list[Send] = []
    step = 0
    while True:
        behind = sorted((i for i in range(1, n) if count[i] < b), key=lambda i: count[i])
        if not behind:
            return sends
        rarest = sorted(range(b), key=lambda r: (copies[r], r))  # this step's preference
        holders = [i for i in range(n) if count[i]]
        busy: set[int] = set()
        moved: list[tuple[int, int]] = []
        for dst in behind:
            if len(holders) > CANDIDATE_SENDERS:
                candidates = [0, *rng.sample(holders, CANDIDATE_SENDERS)]
            else:
                candidates = holders
            best: tuple[int, int, int] | None = None  # (preference, sender, rank)
            for src in candidates:
                if src == dst or src in busy:
                    continue
                wanted = held[src] & ~held[dst]
                if not wanted:
                    continue
                for pos, r in enumerate(rarest):
                    if best is not None and pos >= best[0]:
                        break
                    if wanted >> r & 1:
                        best = (pos, src, r)
                        break
            if best is None:
                continue
            _, src, r = best
            busy.add(src)
            moved.append((dst, r))
            sends.append(Send(step, nodes[src], nodes[dst], order[r]))
        if not moved:
            raise RuntimeError("no sender can feed any target: the sub-group cannot complete")
        for dst, r in moved:  # a block received in this step is sent on from the next
            held[dst] |= 1 << r
            count[dst] += 1
            copies[r] += 1
        step += 1


def pipecast(sources: Sequence[str], targets: Sequence[str], blocks: int, lead: int = 0) -> Plan:
    """The PipeCast plan for a k → k + N scale-out: k = len(sources) sub-groups, each fed by
    its source in Algorithm 1's order (`lead`: see `kway_orders`) along a binomial pipeline."""
    if set(sources) & set(targets):
        raise ValueError("a node is either a source or a target")
    groups = subgroups(sources, targets)
    orders = kway_orders(blocks, len(sources), lead)
    sends = [
        s
        for i, (src, group, order) in enumerate(zip(sources, groups, orders, strict=True))
        for s in binomial_sends(src, group, order, seed=i)
    ]
    return Plan(
        blocks=blocks,
        sources=tuple(sources),
        targets=tuple(targets),
        sends=tuple(sends),
        groups=tuple(tuple(g) for g in groups),
        orders=tuple(tuple(o) for o in orders),
    )


def naive(targets: Sequence[str], blocks: int, source: str = STORE) -> Plan:
    """The baseline: every target reads every block, in order, from `source` (the store)."""
    return Plan(
        blocks=blocks,
        sources=(source,),
        targets=tuple(targets),
        sends=tuple(Send(b, source, t, b) for t in targets for b in range(blocks)),
        groups=(tuple(targets),),
        orders=(tuple(range(blocks)),),
    )


def pipelines(groups: Sequence[Sequence[str]]) -> list[list[str]]:
    """FaaScale Algorithm 2: execution pipelines over the sub-groups' targets. While several
    sub-groups have nodes left, pipeline t takes the t-th remaining node of each (as many
    pipelines as the smallest has nodes); a single sub-group left forms one pipeline of its
    own (its nodes in order)."""
    left = [list(g) for g in groups if g]
    out: list[list[str]] = []
    while left:
        if len(left) == 1:
            out.append(left[0])
            break
        a = min(len(g) for g in left)
        out += [[g[t] for g in left] for t in range(a)]
        left = [g[a:] for g in left if len(g) > a]
    return out


def pipeline_ready_step(plan: Plan, pipeline: Sequence[str]) -> int:
    """The first step after which `pipeline`'s nodes together hold every block (each stage
    then runs the layers of the chunk it holds; -1: never)."""
    for step in range(plan.steps):
        held: set[int] = set()
        for node in pipeline:
            held |= plan.holds_after(node, step)
        if len(held) == plan.blocks:
            return step
    return -1


def transfer_s(
    plan: Plan,
    block_bytes: int,
    link_bps: float,
    store_bps: float | None = None,
) -> dict[str, float]:
    """Seconds until each target holds every block, the sends run as a dataflow: a node sends
    one block at a time and receives one at a time at `link_bps`, a block is sent on only once
    received, and the store (`STORE`, when a source) serves `store_bps` in all (its readers
    share it; None: one link's worth, like any node).

    Each send starts when its sender has the block, the sender's previous send is done, and
    the receiver's previous receipt is done (sends keep the plan's order per sender and per
    receiver); the store's sends of one step share its bandwidth among them."""
    block_s = block_bytes / link_bps
    by_step: dict[int, list[Send]] = defaultdict(list)
    for s in plan.sends:
        by_step[s.step].append(s)
    # The store serves as many readers at once as the plan has it send to in one step, each
    # at its share of the store's bandwidth (never more than a link).
    lanes = max((sum(s.src == STORE for s in sends) for sends in by_step.values()), default=0)
    lane_s = block_bytes / min(link_bps, (store_bps or link_bps) / max(1, lanes))
    lane_free = [0.0] * lanes
    have_at: dict[tuple[str, int], float] = {}
    sender_free: dict[str, float] = defaultdict(float)
    receiver_free: dict[str, float] = defaultdict(float)
    done: dict[str, float] = {t: 0.0 for t in plan.targets}
    for step in sorted(by_step):
        for s in by_step[step]:
            ready = 0.0 if s.src in plan.sources else have_at[(s.src, s.block)]
            if s.src == STORE:
                lane = min(range(lanes), key=lane_free.__getitem__)
                start = max(ready, lane_free[lane], receiver_free[s.dst])
                end = lane_free[lane] = start + lane_s
            else:
                start = max(ready, sender_free[s.src], receiver_free[s.dst])
                end = sender_free[s.src] = start + block_s
            receiver_free[s.dst] = end
            have_at[(s.dst, s.block)] = end
            done[s.dst] = max(done[s.dst], end)
    return done

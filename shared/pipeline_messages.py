"""The messages of execution pipelines (FaaScale §4.3): where a torch checkpoint's layers lie
among its blocks, a stage's wait for them, the stages and the instance served through them.
Defined once here, beside `shared.messages` (which they build on)."""

from __future__ import annotations

from shared.messages import Artifact, Message, ModelRecord

Span = tuple[int, int]
"""Blocks [first, last] of a block set, both included."""


class LayoutQuery(Message, frozen=True):
    artifact: Artifact
    device: str


class StageLayout(Message, frozen=True):
    """Where a torch checkpoint's parts lie among the blocks of its block set (`Tier.TORCH`):
    what a stage running some of its layers needs before it can start."""

    blocks: int
    block_bytes: int
    lead: int
    """Blocks [0, lead) hold the small files and the weights' header: every stage needs them."""
    units: tuple[tuple[Span, ...], ...]
    """The blocks of each unit a stage runs, in order: every decoder layer, then the head
    (the final norm and the output head; a tied head is the embedding)."""
    first: tuple[Span, ...]
    """What the stage running the first unit needs besides (the token embedding)."""


class AwaitBlocks(Message, frozen=True):
    artifact: Artifact
    blocks: tuple[int, ...]
    timeout_s: float = 120.0


class BlocksHeld(Message, frozen=True):
    cache_dir: str
    """Where the (partial) copy is: those blocks of its files are written and checked."""


class StartStage(Message, frozen=True):
    """→ an engine: serve layers [lo, hi) of the model over TCP once its loader holds
    `blocks` (those layers' and what every stage needs)."""

    model: ModelRecord
    lo: int
    hi: int
    layers: int
    blocks: tuple[int, ...]
    nbytes: int = 0
    """What the stage holds, about (its blocks' bytes): reserved with the node's memory
    manager before it loads, as a start's weights are."""


class StageReady(Message, frozen=True):
    node_id: str
    addr: str
    """host:port of the stage's server (`services/engine/torch_engine/stage_wire.py`)."""


class StartPipelined(Message, frozen=True):
    """→ the engine of a pipeline's first stage: serve the model through `stages` (in layer
    order) until this node's own start of it is done."""

    model: ModelRecord
    stages: tuple[str, ...]
    stage_nodes: tuple[str, ...]
    """The node of each stage (told `EndStage` when the pipeline retires)."""
    blocks: tuple[int, ...]
    """What the driver reads from the copy (the small files: tokenizer and config)."""


class EndStage(Message, frozen=True):
    artifact_id: str
    addr: str

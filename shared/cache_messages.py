"""What crosses the bus about the caches, defined once beside `shared.messages`: the engines'
resident models, the loader's host cache and store (staging a compiled form, verifying it,
listing and evicting), and multicasting a model's blocks to several nodes (PipeCast)."""

from __future__ import annotations

from shared.messages import Artifact, Message, Tier


class EvictResidents(Message, frozen=True):
    """Drop resident (idle) models from an engine's pool; all of them when `artifact_id` is ""."""

    artifact_id: str = ""


class Evicted(Message, frozen=True):
    node_id: str
    artifact_ids: tuple[str, ...]
    freed_bytes: int


class StageArtifact(Message, frozen=True):
    """Engine → its node's loader: put the artifact's compiled blob in host memory, verified."""

    artifact: Artifact
    device: str
    tier: Tier = Tier.STEADY
    defer_verify: bool = False
    """On a hit, answer with the blob's place at once and check its blocks after: the engine
    imports it meanwhile and asks for the check's result (`VerifyStaged`) before serving."""


class VerifyStaged(Message, frozen=True):
    """Engine → loader, after a deferred-verify hit: the result of that check."""

    artifact_id: str


class Staged(Message, frozen=True):
    cache_dir: str
    """A directory holding the blob, for OpenVINO's CACHE_DIR."""
    hit: bool
    """True when the blob was already in the host cache (only bad blocks, if any, were re-read)."""
    repaired_blocks: int
    verified: bool = True
    """False on a deferred-verify hit: its blocks are being checked (ask `VerifyStaged`)."""


class CacheQuery(Message, frozen=True):
    """Gateway → a node's loader: what its host block cache holds."""


class CachedArtifact(Message, frozen=True):
    artifact_id: str
    nbytes: int
    tier: str
    uses: int
    last_used: float


class CacheStatus(Message, frozen=True):
    node_id: str
    budget_bytes: int
    used_bytes: int
    entries: tuple[CachedArtifact, ...] = ()
    peer_addr: str = ""
    """host:port of the loader's block server: where other nodes read the blocks it holds."""
    device: str = ""
    """The device its blobs are compiled for (a multicast moves the blob for this device)."""
    torch: bool = False
    """Its node's starts load the torch checkpoint (`Tier.TORCH`), not a compiled blob."""


class Multicast(Message, frozen=True):
    """→ a target node's loader: bring the artifact's compiled blob into its host cache, block
    by block, from the plan's sources (FaaScale PipeCast, `policy.multicast`), serving each
    block on to other targets as soon as it has it."""

    artifact: Artifact
    device: str
    tier: Tier = Tier.STEADY
    feeds: tuple[tuple[int, str], ...] = ()
    """(block, source) in the order to receive them; a source is a peer's `peer_addr`, or
    `policy.multicast.STORE` for the model store."""
    plan_sources: tuple[str, ...] = ()
    plan_targets: tuple[str, ...] = ()
    """Instead of `feeds`: the plan's sources and targets (`peer_addr`s, this node's among the
    targets). Every target derives the same PipeCast plan from them and the block count it
    reads from the store, and takes its own feeds: the sender need not know the blocks."""
    fallbacks: tuple[str, ...] = ("store",)
    """Where a block comes from when its planned source fails, in order."""
    timeout_s: float = 30.0
    """Longest one block may take from one source before that source counts as failed."""
    lead: int = 0
    """The plan's first `lead` blocks go first in every sub-group's order (what every stage
    of an execution pipeline needs: a torch checkpoint's small files and weights header)."""


class MulticastDone(Message, frozen=True):
    node_id: str
    blocks: int
    nbytes: int
    seconds: float
    refetched: int = 0
    """Blocks that came from a fallback (their planned source died or sent a bad block)."""
    corrupt: int = 0
    """Blocks that failed their checksum on arrival (each refetched)."""
    dead_sources: tuple[str, ...] = ()


class EvictHostCache(Message, frozen=True):
    artifact_id: str = ""
    forget_store_pages: bool = False
    """Also drop the store's copy from the OS page cache, so the next start reads the disk."""

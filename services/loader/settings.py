from __future__ import annotations

import os
from pathlib import Path

from pydantic import Field

from shared.settings import CommonSettings

START_TIER_MAX_WEIGHT_BYTES = 512 * 1024**2
"""`LoaderSettings.start_tier_max_weight_bytes`'s default."""


def default_host_cache_bytes() -> int:
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return max(4 * 1024**3, physical // 4)


class LoaderSettings(CommonSettings):
    http_port: int = 8103
    import_timeout_s: float = 600.0
    """Longest a GGUF conversion may take before the import fails."""
    host_cache_dir: Path = Path("/dev/shm/tessera")
    """tmpfs directory of the host block cache (one subdirectory per node)."""
    host_cache_bytes: int = Field(default_factory=lambda: default_host_cache_bytes())
    """What the host block cache may hold: by default a quarter of the machine's memory, and at
    least 4 GiB. A fixed 4 GiB held a 1.7B model's compiled blob (1.2 GB) but not a 7-8B one's
    (4.8 GB at int4, bench/results/start_tier.json), whose every cold start then read the disk."""
    fill_delay_s: float = 2.0
    """After a miss, wait this long before copying the blob into the host cache, so that the
    copy does not compete with the start that is reading it for the node's cores and disk."""
    peer_host: str = "127.0.0.1"
    """Where the block server listens: the address other nodes read this node's blocks at."""
    peer_port: int = 0
    """0: a free port (CacheStatus says which)."""
    link_bps: float = 0.0
    """Shape the block server's uplink to this many bytes/s (0: unshaped): a cluster on one
    machine then moves blocks as a network-bound one does."""
    store_addr: str = ""
    """A block server in front of the model store (host:port), for a store other nodes share
    over the network; empty: read the store directory."""
    allowed_model_dirs: list[Path] = Field(default_factory=list)
    """If set, imports may only read GGUFs under these directories."""
    max_adapter_rank: int = 256
    """Largest LoRA rank an adapter may have (vLLM's `--max-lora-rank`, whose largest choice
    is 512): a higher one is a 400 at registration, not a memory surprise at a start."""
    start_tier_max_weight_bytes: int = START_TIER_MAX_WEIGHT_BYTES
    """Write (and compile) an artifact's start tier only where its packed weights
    (`Artifact.weight_bytes`) are at most this; above it the artifact has none, and its
    engine serves from the continuous-batching core from the first token. Measured
    (bench/results/start_tier.json, SmolLM2 135M/360M/1.7B Q4): the start tier costs 3.4x the
    GGUF in the store at every size and +1.9 GB RSS at 1.7B, and decodes 1.2-1.6x slower per
    token; what it buys is a cheaper first token (a sixth to a third of the core's CPU), which
    the core's faster decode overtakes after ≈ 180-190 tokens at 135M/360M (92 and 209 MB
    packed) but ≈ 40 at 1.7B (917 MB) and 7.2B: worth it only for a small model."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field

from shared.settings import CommonSettings


class LoaderSettings(CommonSettings):
    http_port: int = 8103
    import_timeout_s: float = 600.0
    """Longest a GGUF conversion may take before the import fails."""
    host_cache_dir: Path = Path("/dev/shm/tessera")
    """tmpfs directory of the host block cache (one subdirectory per node)."""
    host_cache_bytes: int = 4 * 1024**3
    fill_delay_s: float = 2.0
    """After a miss, wait this long before copying the blob into the host cache, so that the
    copy does not compete with the start that is reading it for the node's cores and disk."""
    allowed_model_dirs: list[Path] = Field(default_factory=list)
    """If set, imports may only read GGUFs under these directories."""

from __future__ import annotations

from pathlib import Path

from shared.settings import CommonSettings


class LoaderSettings(CommonSettings):
    http_port: int = 8103
    import_timeout_s: float = 600.0
    """Longest a GGUF conversion may take before the import fails."""
    allowed_model_dirs: list[Path] = []
    """If set, imports may only read GGUFs under these directories."""

"""The loader's conversion (`services.loader.convert.convert`) of a GGUF it may not write.

OpenVINO GenAI opens the GGUF read-write, so a source on a read-only mount, or one owned by
another user (the image's bundled default model for the non-root services), cannot be handed to
it directly: `convert` copies such a source next to the IR it writes. Where this test runs as root
with mount namespaces it converts from a real read-only bind mount (root bypasses file modes, not
a read-only mount); elsewhere it makes `os.access` say the source is not writable.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from services.loader.store import IR_FILES, read_artifact


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def can_mount_read_only() -> bool:
    """Root, with `unshare` allowed to make a mount namespace of its own."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "-m", "true"], capture_output=True, timeout=30)
    return probe.returncode == 0


def test_convert_copies_a_source_it_may_not_write(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from ops.localcluster import default_model_path

    models = tmp_path / "models"
    models.mkdir()
    source = models / "model.gguf"
    shutil.copyfile(default_model_path(), source)
    before = (sha256(source), source.stat().st_mtime_ns, source.stat().st_size)
    dest = tmp_path / "store" / "artifact"

    if can_mount_read_only():
        script = textwrap.dedent(
            f"""
            import sys
            from pathlib import Path
            from services.loader.convert import convert
            convert(Path({str(source)!r}), Path({str(dest)!r}), "0" * 64, "read-only")
            """
        )
        shell = (
            'mount --bind "$1" "$1" && mount -o remount,bind,ro "$1" '
            '&& ! touch "$1/probe" 2>/dev/null && exec "$2" -c "$3"'
        )
        result = subprocess.run(
            ["unshare", "-m", "sh", "-c", shell, "sh", str(models), sys.executable, script],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=Path(__file__).resolve().parents[2],
        )
        assert result.returncode == 0, result.stderr[-4000:]
        assert not (models / "probe").exists(), "the source directory was not mounted read-only"
    else:
        real_access = os.access

        def access(path: object, mode: int, *args: object, **kwargs: object) -> bool:
            if mode & os.W_OK and Path(str(path)).resolve() == source.resolve():
                return False
            return real_access(path, mode, *args, **kwargs)  # type: ignore[arg-type]

        monkeypatch.setattr(os, "access", access)
        from services.loader.convert import convert

        convert(source, dest, "0" * 64, "read-only")

    artifact = read_artifact(dest)
    assert artifact is not None and artifact.artifact_id == "read-only"
    assert all((dest / f).is_file() for f in IR_FILES)
    assert not (dest / "model.gguf").exists(), "the copy of the GGUF was left in the artifact"
    assert not [p for p in dest.parent.iterdir() if p.name.startswith(".")], "a temporary directory was left"
    assert (sha256(source), source.stat().st_mtime_ns, source.stat().st_size) == before, "the source changed"

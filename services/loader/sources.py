"""What a client's source path may be, checked before anything is read or written: an absolute
path under the allowed model directories, a GGUF (by its magic) or a model directory (by its
files), or an adapter's directory; and the weight format an import keeps. A refusal is an
`ImportRefused` whose message quotes the path cut to a bounded length."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from importlib.util import find_spec
from pathlib import Path
from typing import TypeVar

from services.loader.formats import NotImportable, checkpoint_params, default_weight_format, source_format
from shared.messages import SourceFormat, WeightFormat

T = TypeVar("T")

HF_EXPORT_MODULES = ("torch", "transformers", "nncf")
"""What exporting a Hugging Face checkpoint needs (`hf_export.py`): the `hf` extra, not a base install."""


class ImportRefused(Exception):
    """A source that cannot be imported, for a reason the client can act on: answered, and
    logged as a warning (no traceback: nothing in the loader went wrong)."""


SHOWN_SOURCE_CHARS = 200
"""Most characters of a client's source path put in an answer or a log line: a path may be as
long as the body allows (100 KB were sent), and one request must not flood the log."""


def shown(source: str) -> str:
    """`source` for a message: quoted, cut to `SHOWN_SOURCE_CHARS` with its length said."""
    if len(source) <= SHOWN_SOURCE_CHARS:
        return repr(source)
    return f"{source[:SHOWN_SOURCE_CHARS]!r}... ({len(source)} characters)"


def readable(source: str, read: Callable[[str], T]) -> T:
    """`read(source)`, its failure to read the path an `ImportRefused` that says why."""
    try:
        return read(source)
    except RuntimeError:  # pathlib's "Symlink loop from ..." (Python 3.11)
        raise ImportRefused(f"source {shown(source)} cannot be read: a symlink loop") from None
    except NotImportable as e:
        raise ImportRefused(f"source {shown(source)} is {e}") from None
    except OSError as e:  # too long a name, a loop, no permission: the error's words, not its path
        why = e.strerror or type(e).__name__
        raise ImportRefused(f"source {shown(source)} cannot be read: {why}") from None


def allowed(source: str, what: str, allowed_dirs: Sequence[Path]) -> Path:
    """`source` resolved, if it is absolute and under the allowed model directories (any, where
    none are set)."""
    path = Path(source).expanduser()
    if not path.is_absolute():
        raise ImportRefused(f"source must be an absolute path to {what}, got {shown(source)}")
    path = path.resolve()
    dirs = [d.resolve() for d in allowed_dirs]
    if dirs and not any(path.is_relative_to(d) for d in dirs):
        raise ImportRefused(f"source {shown(source)} is outside the allowed model directories")
    return path


def model_source(source: str, allowed_dirs: Sequence[Path]) -> tuple[Path, SourceFormat]:
    """A model's source and its format: a GGUF file, or a Hugging Face or OpenVINO directory."""
    path = allowed(source, "a .gguf file or a model directory", allowed_dirs)
    if path.is_dir():
        return path, source_format(f.name for f in path.iterdir() if f.is_file())
    if path.suffix.lower() != ".gguf" or not path.is_file():
        raise ImportRefused(
            f"source {shown(source)} is not a readable .gguf file, nor a model directory "
            "(a Hugging Face checkpoint or an OpenVINO IR)"
        )
    with path.open("rb") as f:
        if f.read(4) != b"GGUF":
            raise ImportRefused(f"source {shown(source)} is not a GGUF file (bad magic)")
    return path, SourceFormat.GGUF


def adapter_source(source: str, allowed_dirs: Sequence[Path]) -> Path:
    """An adapter's source: a directory (what PEFT's `save_pretrained` writes)."""
    path = allowed(source, "an adapter directory", allowed_dirs)
    if not path.is_dir():
        raise ImportRefused(f"source {shown(source)} is not a directory (a PEFT adapter's)")
    return path


def kept_weight_format(path: Path, kind: SourceFormat, asked: WeightFormat | None) -> WeightFormat | None:
    """What the import keeps: a checkpoint's asked-for format or its size's default; an IR's
    asked-for one (checked against what it holds); a GGUF keeps its own quantization."""
    if kind is SourceFormat.GGUF and asked is not None:
        raise ImportRefused("weight_format applies to a Hugging Face checkpoint (a GGUF keeps its own quantization)")
    if kind is SourceFormat.HF and (missing := [m for m in HF_EXPORT_MODULES if find_spec(m) is None]):
        raise ImportRefused(
            f"this loader cannot export a Hugging Face checkpoint: {', '.join(missing)} not installed "
            "(install tessera[hf]; or register the checkpoint's OpenVINO IR or a GGUF)"
        )
    if kind is SourceFormat.HF and asked is None:
        return default_weight_format(checkpoint_params(path))
    return asked

"""Convert one GGUF into an artifact directory: `python -m services.loader.convert SRC DEST SHA`.

Runs in a process of its own so that the conversion's memory (the whole model, twice) goes
back to the system when it ends. Writes into a temporary sibling and renames it into place,
so a crash never leaves a half-written artifact that looks complete.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

import gguf
import openvino as ov
import openvino_genai as ov_genai

from services.loader.store import IR_FILES, kv_bytes_per_token, write_artifact
from shared.messages import Artifact


def gguf_facts(source: Path) -> dict[str, int | str]:
    reader = gguf.GGUFReader(str(source))
    fields = reader.fields

    def value(key: str) -> int | str:
        return fields[key].contents()  # type: ignore[no-any-return]

    arch = str(value("general.architecture"))
    heads = int(value(f"{arch}.attention.head_count"))
    kv_heads = int(value(f"{arch}.attention.head_count_kv")) if f"{arch}.attention.head_count_kv" in fields else heads
    embedding = int(value(f"{arch}.embedding_length"))
    return {
        "architecture": arch,
        "context_length": int(value(f"{arch}.context_length")),
        "layers": int(value(f"{arch}.block_count")),
        "kv_heads": kv_heads,
        "head_dim": embedding // heads,
    }


def convert(source: Path, dest: Path, source_sha256: str, artifact_id: str) -> Artifact:
    facts = gguf_facts(source)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}-", dir=dest.parent))
    try:
        link = tmp / "model.gguf"
        link.symlink_to(source.resolve())
        # enable_save_ov_model writes the IR and the tokenizer models next to the GGUF.
        pipe = ov_genai.LLMPipeline(str(link), "CPU", enable_save_ov_model=True)
        del pipe
        link.unlink()
        missing = [f for f in IR_FILES if not (tmp / f).is_file()]
        if missing:
            raise RuntimeError(f"conversion did not write {missing}")
        artifact = Artifact(
            artifact_id=artifact_id,
            path=str(dest.resolve()),
            source_sha256=source_sha256,
            context_length=int(facts["context_length"]),
            kv_bytes_per_token=kv_bytes_per_token(
                int(facts["layers"]), int(facts["kv_heads"]), int(facts["head_dim"])
            ),
            weight_bytes=(tmp / "openvino_model.bin").stat().st_size,
            architecture=str(facts["architecture"]),
            openvino_version=ov.get_version(),
        )
        write_artifact(tmp, artifact)
        if dest.exists():
            shutil.rmtree(dest)
        tmp.rename(dest)
        return artifact
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    src, dst, sha, aid = sys.argv[1:5]
    convert(Path(src), Path(dst), sha, aid)

"""Import one GGUF into an artifact directory and materialize it:
`python -m services.loader.convert SRC DEST SHA ARTIFACT_ID DEVICE THREADS`.

Two steps, each skipped when already done:
1. GGUF → OpenVINO IR and compiled tokenizer/detokenizer (written into a temporary sibling
   and renamed into place, so a crash never leaves a half-written artifact that looks whole);
2. materialization (MEDUSA §2.5, §6): compile the IR for the device into the artifact's
   `compiled/<device>` cache, exactly as the engine will, and run one forward pass to check it.
   A cold start then imports the blob instead of compiling.
Runs in a process of its own so that its memory (the whole model, twice) goes back to the
system when it ends.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

import gguf
import numpy as np
import openvino as ov
import openvino_genai as ov_genai

from services.engine.instance import MODEL_XML, compile_config, compiled_cache_dir
from services.loader.store import IR_FILES, kv_bytes_per_token, read_artifact, write_artifact
from shared.messages import Artifact


def gguf_facts(source: Path) -> dict[str, int | str]:
    reader = gguf.GGUFReader(str(source))
    fields = reader.fields

    def value(key: str) -> int | str:
        return fields[key].contents()  # type: ignore[no-any-return]

    arch = str(value("general.architecture"))
    heads = int(value(f"{arch}.attention.head_count"))
    kv_key = f"{arch}.attention.head_count_kv"
    kv_heads = int(value(kv_key)) if kv_key in fields else heads
    return {
        "architecture": arch,
        "context_length": int(value(f"{arch}.context_length")),
        "layers": int(value(f"{arch}.block_count")),
        "kv_heads": kv_heads,
        "head_dim": int(value(f"{arch}.embedding_length")) // heads,
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


def is_materialized(artifact: Artifact, device: str) -> bool:
    cache = compiled_cache_dir(artifact, device)
    return cache.is_dir() and any(cache.glob("*.blob"))


def materialize(artifact: Artifact, device: str, threads: int) -> None:
    """Compile at the artifact's final path (OpenVINO's cache key includes it) and check
    that the compiled model runs."""
    cache = compiled_cache_dir(artifact, device)
    shutil.rmtree(cache, ignore_errors=True)
    core = ov.Core()
    compiled = core.compile_model(
        str(Path(artifact.path) / MODEL_XML), device, compile_config(artifact, device, threads)
    )
    req = compiled.create_infer_request()
    req.infer({
        "input_ids": np.ones((1, 1), dtype=np.int64),
        "attention_mask": np.ones((1, 1), dtype=np.int64),
        "position_ids": np.zeros((1, 1), dtype=np.int64),
        "beam_idx": np.zeros(1, dtype=np.int32),
    })
    if not is_materialized(artifact, device):
        raise RuntimeError(f"compiling {artifact.artifact_id} for {device} left no blob in {cache}")
    from services.loader.hostcache import write_manifest

    write_manifest(artifact, device)


def main(argv: list[str]) -> None:
    src, dst, sha, aid, device, threads = argv
    dest = Path(dst)
    artifact = read_artifact(dest) or convert(Path(src), dest, sha, aid)
    if not is_materialized(artifact, device):
        materialize(artifact, device, int(threads))


if __name__ == "__main__":
    main(sys.argv[1:])

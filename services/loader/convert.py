"""Import one source into an artifact directory and materialize it:
`python -m services.loader.convert SRC DEST SHA ARTIFACT_ID DEVICE THREADS BACKEND [FORMAT WEIGHT_FORMAT]`.

Two steps, each skipped when already done:
1. the source → OpenVINO IR and compiled tokenizer/detokenizer (written into a temporary sibling
   and renamed into place, so a crash never leaves a half-written artifact that looks whole):
   a GGUF through OpenVINO GenAI's reader, a Hugging Face checkpoint through the exporter
   (`hf_export.py`, weights compressed to WEIGHT_FORMAT), an OpenVINO IR directory copied;
2. materialization (MEDUSA §2.5, §6): write the start tier's IR (`start_ir.py`; only for an
   artifact whose packed weights are at most `LoaderSettings.start_tier_max_weight_bytes`, as
   recorded in `Artifact.start_tier`), compile its tiers for the device into the artifact's
   `compiled/<device>[-start]` caches, exactly as the engine will, run one forward pass
   through each to check it, and write each blob's block manifest. A cold start then imports a blob instead of compiling;
3. where the node's engine is torch (`python -m services.loader.convert ... torch`), a torch
   checkpoint from the same GGUF or Hugging Face checkpoint (`torch_checkpoint.py`) into the
   artifact's `torch/`.
A source refused for a reason the client can act on (an architecture the exporter does not
know, an IR on a torch node) ends the process with `REFUSED_EXIT` and the reason as the last
line of its stderr.
Runs in a process of its own so that its memory (the whole model, twice) goes back to the
system when it ends.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import NamedTuple, TypedDict

import gguf
import openvino as ov
import openvino_genai as ov_genai

from services.loader.formats import REFUSED_EXIT, NotImportable, weight_format_of
from services.loader.settings import START_TIER_MAX_WEIGHT_BYTES, LoaderSettings
from services.loader.start_ir import start_tier_wins, write_start_ir
from services.loader.store import IR_FILES, kv_bytes_per_token, read_artifact, write_artifact
from shared.artifact import (
    START_DIR,
    compile_config,
    compiled_cache_dir,
    compiled_tiers,
    first_pass,
    has_tier,
    has_torch_checkpoint,
    is_materialized,
    model_xml,
    reads_torch_checkpoint,
    torch_checkpoint,
)
from shared.messages import Artifact, SourceFormat, Tier, WeightFormat

SAMPLING_KEYS = {"temp": "temperature", "top_p": "top_p", "penalty_repeat": "repetition_penalty"}
"""GGUF's recommended-sampling keys (`general.sampling.*`) and the defaults they set."""


class ModelFacts(TypedDict):
    """What an artifact needs from a GGUF's metadata or a checkpoint's config."""

    sampling: dict[str, float]
    architecture: str
    context_length: int
    layers: int
    kv_heads: int
    head_dim: int


def gguf_facts(source: Path) -> ModelFacts:
    reader = gguf.GGUFReader(str(source))
    fields = reader.fields

    def value(key: str) -> int | str:
        return fields[key].contents()  # type: ignore[no-any-return]

    arch = str(value("general.architecture"))
    heads = int(value(f"{arch}.attention.head_count"))
    kv_key = f"{arch}.attention.head_count_kv"
    kv_heads = int(value(kv_key)) if kv_key in fields else heads
    sampling = {
        name: float(fields[f"general.sampling.{key}"].contents())
        for key, name in SAMPLING_KEYS.items()
        if f"general.sampling.{key}" in fields
    }
    return {
        "sampling": sampling,
        "architecture": arch,
        "context_length": int(value(f"{arch}.context_length")),
        "layers": int(value(f"{arch}.block_count")),
        "kv_heads": kv_heads,
        "head_dim": int(value(f"{arch}.embedding_length")) // heads,
    }


def convert(
    source: Path,
    dest: Path,
    source_sha256: str,
    artifact_id: str,
    start_tier_max_weight_bytes: int = START_TIER_MAX_WEIGHT_BYTES,
) -> Artifact:
    """`start_tier_max_weight_bytes`: the artifact gets a start tier (`materialize` writes it)
    only where its packed weights are at most this (`start_ir.start_tier_wins`)."""
    facts = gguf_facts(source)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}-", dir=dest.parent))
    try:
        link = tmp / "model.gguf"
        # OpenVINO GenAI opens the GGUF read-write (it never writes it), so it fails on a source
        # this process may not write: a read-only mount, a file of another user (the image's
        # bundled model for the non-root services), a read-only bind-mounted model directory.
        # Such a source is copied next to the IR (a hard link would keep the inode's permissions
        # and cannot cross mounts); a writable one is linked, saving a copy of a large model.
        resolved = source.resolve()
        if os.access(resolved, os.W_OK):
            link.symlink_to(resolved)
        else:
            shutil.copyfile(resolved, link)
        # enable_save_ov_model writes the IR and the tokenizer models next to the GGUF.
        pipe = ov_genai.LLMPipeline(str(link), "CPU", enable_save_ov_model=True)
        del pipe
        link.unlink()
        return _place(
            tmp, dest, Meta(source_sha256, artifact_id, SourceFormat.GGUF, start_tier_max_weight_bytes), facts
        )
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


class Meta(NamedTuple):
    """What an artifact is besides its model's facts."""

    source_sha256: str
    artifact_id: str
    source_format: SourceFormat
    start_tier_max_weight_bytes: int


def _place(tmp: Path, dest: Path, meta: Meta, facts: ModelFacts, asked: WeightFormat | None = None) -> Artifact:
    """The artifact of the IR converted into `tmp`, written there, and `tmp` renamed to `dest`
    (a crash never leaves a half-written artifact that looks whole). `asked`: the weight format
    the IR must hold (`NotImportable` where it holds another)."""
    missing = [f for f in IR_FILES if not (tmp / f).is_file()]
    if missing:
        raise RuntimeError(f"conversion did not write {missing}")
    found = ir_weight_format(tmp / "openvino_model.xml")
    if asked is not None and found != asked:
        raise NotImportable(
            f"the OpenVINO IR holds {found} weights, not {asked}: an IR is served as it was "
            "exported (export it with that --weight-format, or register its Hugging Face checkpoint)"
        )
    weight_bytes = (tmp / "openvino_model.bin").stat().st_size
    artifact = Artifact(
        artifact_id=meta.artifact_id,
        path=str(dest.resolve()),
        source_sha256=meta.source_sha256,
        context_length=facts["context_length"],
        kv_bytes_per_token=kv_bytes_per_token(facts["layers"], facts["kv_heads"], facts["head_dim"]),
        weight_bytes=weight_bytes,
        architecture=facts["architecture"],
        openvino_version=ov.get_version(),
        sampling=dict(facts["sampling"]),
        start_tier=start_tier_wins(weight_bytes, meta.start_tier_max_weight_bytes, found),
        source_format=meta.source_format,
        weight_format=found,
    )
    write_artifact(tmp, artifact)
    if dest.exists():
        shutil.rmtree(dest)
    tmp.rename(dest)
    return artifact


def ir_weight_format(model_xml: Path) -> WeightFormat:
    """The weight format of the IR at `model_xml`, from its constants (`formats.weight_format_of`)."""
    by_type: dict[str, int] = {}
    for node in ov.Core().read_model(str(model_xml)).get_ordered_ops():
        if node.get_type_name() == "Constant" and node.get_output_size() == 1:
            kind = node.get_output_element_type(0).get_type_name()
            by_type[kind] = by_type.get(kind, 0) + node.get_byte_size()
    return weight_format_of(by_type)


GENERATION_KEYS = ("temperature", "top_p", "repetition_penalty")
"""generation_config.json's sampling defaults an artifact keeps (as a GGUF's `general.sampling.*`)."""


def checkpoint_facts(directory: Path) -> ModelFacts:
    """What an artifact needs from a checkpoint's (or an exported IR's) config.json, and its
    generation_config.json's sampling where it samples."""
    config = json.loads((directory / "config.json").read_text())
    text = config.get("text_config", config)  # a multimodal config keeps the decoder's apart
    heads = int(text["num_attention_heads"])
    generation = directory / "generation_config.json"
    gen = json.loads(generation.read_text()) if generation.is_file() else {}
    sampling = {k: float(gen[k]) for k in GENERATION_KEYS if gen.get("do_sample") and k in gen}
    return {
        "architecture": str(text.get("model_type") or config.get("model_type", "")),
        "context_length": int(text.get("max_position_embeddings", 2048)),
        "layers": int(text["num_hidden_layers"]),
        "kv_heads": int(text.get("num_key_value_heads") or heads),
        "head_dim": int(text.get("head_dim") or int(text["hidden_size"]) // heads),
        "sampling": sampling,
    }


def known_architecture(checkpoint: Path) -> None:
    """Refuse (`NotImportable`) a checkpoint whose config.json names a model transformers has
    no causal language model for: the exporter traces transformers' model code."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type = json.loads((checkpoint / "config.json").read_text()).get("model_type", "")
    try:
        AutoConfig.from_pretrained(checkpoint)
    except (ValueError, KeyError):
        raise NotImportable(f"architecture {model_type!r} is not one the converter (transformers) knows") from None
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise NotImportable(f"architecture {model_type!r} is not a causal language model the converter knows")


def convert_directory(
    source: Path,
    kind: SourceFormat,
    dest: Path,
    source_sha256: str,
    artifact_id: str,
    weight_format: WeightFormat | None,
    start_tier_max_weight_bytes: int = START_TIER_MAX_WEIGHT_BYTES,
) -> Artifact:
    """A Hugging Face checkpoint exported to IR in `weight_format`, or an OpenVINO IR directory
    copied as it is, into `dest` (through a temporary sibling renamed into place)."""
    if kind is SourceFormat.HF:
        known_architecture(source)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}-", dir=dest.parent))
    try:
        if kind is SourceFormat.HF:
            from services.loader.hf_export import export

            export(source, tmp, weight_format or WeightFormat.INT8)
        else:
            for f in source.iterdir():
                if f.is_file():
                    shutil.copyfile(f, tmp / f.name)
        facts = checkpoint_facts(tmp if (tmp / "config.json").is_file() else source)
        meta = Meta(source_sha256, artifact_id, kind, start_tier_max_weight_bytes)
        return _place(tmp, dest, meta, facts, weight_format if kind is SourceFormat.OPENVINO else None)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _write_start_ir(artifact: Artifact) -> None:
    """Into a temporary sibling, then renamed: a crash never leaves half a start tier. None
    for an artifact recorded without one (`Artifact.start_tier`)."""
    final = Path(artifact.path) / START_DIR
    if not artifact.start_tier or model_xml(artifact, Tier.START).is_file():
        return
    tmp = Path(tempfile.mkdtemp(prefix=f".{START_DIR}-", dir=artifact.path))
    try:
        write_start_ir(model_xml(artifact, Tier.STEADY), tmp)
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def materialize(artifact: Artifact, device: str, threads: int) -> None:
    """Compile each missing tier at the artifact's final path (OpenVINO's cache key includes
    it) and check that the compiled model runs."""
    from services.loader.hostcache import write_manifest

    _write_start_ir(artifact)
    core = ov.Core()
    for tier in compiled_tiers(artifact):
        if has_tier(artifact, device, tier):
            continue
        cache = compiled_cache_dir(artifact, device, tier)
        shutil.rmtree(cache, ignore_errors=True)
        compiled = core.compile_model(
            str(model_xml(artifact, tier)), device, compile_config(artifact, device, threads, tier=tier)
        )
        first_pass(compiled)
        del compiled
        if not has_tier(artifact, device, tier):
            raise RuntimeError(f"compiling {artifact.artifact_id} ({tier}) for {device} left no blob in {cache}")
        write_manifest(artifact, device, tier)


def main(argv: list[str]) -> None:
    src, dst, sha, aid, device, threads, *rest = argv
    backend = rest[0] if rest else "openvino"
    kind = SourceFormat(rest[1]) if len(rest) > 1 else SourceFormat.GGUF
    weight_format = WeightFormat(rest[2]) if len(rest) > 2 and rest[2] else None
    dest = Path(dst)
    # The loader's settings reach this process through its environment (TESSERA_*).
    max_start = LoaderSettings().start_tier_max_weight_bytes
    if reads_torch_checkpoint(backend) and kind is SourceFormat.OPENVINO:
        raise NotImportable("a torch node serves a GGUF or a Hugging Face checkpoint, not an OpenVINO IR")
    artifact = read_artifact(dest) or (
        convert(Path(src), dest, sha, aid, max_start)
        if kind is SourceFormat.GGUF
        else convert_directory(Path(src), kind, dest, sha, aid, weight_format, max_start)
    )
    if reads_torch_checkpoint(backend):
        if not has_torch_checkpoint(artifact):
            from services.loader.torch_checkpoint import host_dtype, materialize_into

            materialize_into(Path(src), torch_checkpoint(artifact), host_dtype())
    elif not is_materialized(artifact, device):
        materialize(artifact, device, int(threads))


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except NotImportable as e:
        print(f"refused: {e}", file=sys.stderr)
        sys.exit(REFUSED_EXIT)

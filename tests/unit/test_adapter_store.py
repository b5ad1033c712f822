"""The loader's adapter import on real files (`services/loader/adapters.py`): a fitting adapter
is kept whole beside its base's artifact (its bytes, its config, a manifest written last), found
again by a second import, and a refused one leaves nothing behind. Adapters written here with
numpy in PEFT's layout (the e2e test uses PEFT's own: tests/e2e/test_adapters.py)."""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from policy.adapters import AdapterRefused
from services.loader.adapters import import_adapter
from services.loader.hostcache import ADAPTER_FILES, HostCache, adapter_key
from shared.adapters import ADAPTER_CONFIG, ADAPTER_MANIFEST, ADAPTER_WEIGHTS, adapter_dir, read_manifest
from shared.messages import Artifact, ModelRecord, SourceFormat

HIDDEN, RANK = 64, 4


def _base(tmp_path: Path) -> ModelRecord:
    artifact = tmp_path / "store" / "base-ov2026"
    artifact.mkdir(parents=True)
    (artifact / "config.json").write_text(
        json.dumps(
            {
                "model_type": "llama",
                "hidden_size": HIDDEN,
                "intermediate_size": 128,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
            }
        )
    )
    return ModelRecord(
        name="base",
        source=str(tmp_path / "checkpoint"),
        artifact=Artifact(
            artifact_id="base-ov2026",
            path=str(artifact),
            source_sha256="0" * 64,
            context_length=128,
            kv_bytes_per_token=1,
            weight_bytes=1,
            source_format=SourceFormat.HF,
        ),
        ttft_slo_s=2.0,
        tpot_slo_s=0.1,
        keep_alive_s=60.0,
        created_at=0.0,
    )


def _adapter(dest: Path, dtype: type = np.float32, poison: bool = False) -> Path:
    dest.mkdir(parents=True)
    rng = np.random.default_rng(0)
    tensors = {}
    for layer in range(2):
        prefix = f"base_model.model.model.layers.{layer}.self_attn.q_proj"
        tensors[f"{prefix}.lora_A.weight"] = rng.standard_normal((RANK, HIDDEN)).astype(dtype)
        tensors[f"{prefix}.lora_B.weight"] = rng.standard_normal((HIDDEN, RANK)).astype(dtype)
    if poison:
        tensors[f"{prefix}.lora_B.weight"][0, 0] = np.nan
    save_file(tensors, dest / ADAPTER_WEIGHTS)
    (dest / ADAPTER_CONFIG).write_text(
        json.dumps({"peft_type": "LORA", "r": RANK, "lora_alpha": 8, "target_modules": ["q_proj"]})
    )
    return dest


def test_a_fitting_adapter_is_kept_whole_beside_its_base_and_found_again(tmp_path: Path) -> None:
    base = _base(tmp_path)
    source = _adapter(tmp_path / "adapter")
    first = import_adapter(base, source, max_rank=64)
    kept = first.adapter
    assert first.converted and kept.rank == RANK and kept.scale == 2.0 and kept.targets == ("q_proj",)
    where = adapter_dir(base.artifact, kept.adapter_id)
    assert Path(kept.path) == where and sorted(p.name for p in where.iterdir()) == sorted(
        [ADAPTER_CONFIG, ADAPTER_MANIFEST, ADAPTER_WEIGHTS]
    )
    weights = (where / ADAPTER_WEIGHTS).read_bytes()
    assert weights == (source / ADAPTER_WEIGHTS).read_bytes()
    assert kept.sha256 == hashlib.sha256(weights).hexdigest() and kept.nbytes == len(weights)
    assert read_manifest(where) == kept

    again = import_adapter(base, source, max_rank=64)
    assert not again.converted and again.adapter == kept
    assert [p.name for p in where.parent.iterdir()] == [kept.adapter_id]  # no temporary left


def test_a_copy_left_without_its_manifest_is_not_taken_and_is_replaced(tmp_path: Path) -> None:
    base = _base(tmp_path)
    source = _adapter(tmp_path / "adapter")
    kept = import_adapter(base, source, max_rank=64).adapter
    where = Path(kept.path)
    (where / ADAPTER_MANIFEST).unlink()  # as a crash between the copy and the manifest leaves it
    (where / ADAPTER_WEIGHTS).write_bytes(b"half")
    assert read_manifest(where) is None
    redone = import_adapter(base, source, max_rank=64)
    assert redone.converted and (where / ADAPTER_WEIGHTS).read_bytes() == (source / ADAPTER_WEIGHTS).read_bytes()


def _as_bfloat16(weights: Path) -> None:
    """Rewrite an f32 safetensors file as bfloat16 (numpy has no such type: float32's upper
    halves, written with a header by hand)."""
    tensors = load_file(weights)
    header: dict[str, object] = {}
    data = b""
    for name, array in tensors.items():
        raw = (array.astype("<f4").view("<u4") >> 16).astype("<u2").tobytes()
        header[name] = {"dtype": "BF16", "shape": list(array.shape), "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    text = json.dumps(header).encode()
    weights.write_bytes(struct.pack("<Q", len(text)) + text + data)


@pytest.mark.parametrize("dtype", ["F16", "BF16"])
def test_half_precision_matrices_are_read_for_their_check(tmp_path: Path, dtype: str) -> None:
    base = _base(tmp_path)
    source = _adapter(tmp_path / "adapter", dtype=np.float16 if dtype == "F16" else np.float32)
    if dtype == "BF16":
        _as_bfloat16(source / ADAPTER_WEIGHTS)
    assert import_adapter(base, source, max_rank=64).adapter.dtype == dtype


def test_an_infinity_in_bfloat16_is_found(tmp_path: Path) -> None:
    base = _base(tmp_path)
    source = _adapter(tmp_path / "adapter", poison=True)
    _as_bfloat16(source / ADAPTER_WEIGHTS)
    with pytest.raises(AdapterRefused, match="NaN or infinite"):
        import_adapter(base, source, max_rank=64)


@pytest.mark.parametrize("why", ["nan", "rank", "no-weights"])
def test_a_refused_adapter_leaves_nothing_in_the_store(tmp_path: Path, why: str) -> None:
    base = _base(tmp_path)
    source = _adapter(tmp_path / "adapter", poison=why == "nan")
    if why == "no-weights":
        (source / ADAPTER_WEIGHTS).unlink()
    says = {"nan": "NaN or infinite", "rank": "above this cluster's largest", "no-weights": "no adapter_model"}[why]
    with pytest.raises(AdapterRefused, match=says):
        import_adapter(base, source, max_rank=2 if why == "rank" else 64)
    assert not (Path(base.artifact.path) / "adapters").exists()


def test_a_kept_adapter_is_copied_into_the_host_cache_checked_and_repaired_there(tmp_path: Path) -> None:
    base = _base(tmp_path)
    kept = import_adapter(base, _adapter(tmp_path / "adapter"), max_rank=64).adapter
    cache = HostCache(tmp_path / "shm", budget_bytes=64 * 1024 * 1024)

    assert cache.verify_adapter(kept) is None  # a miss: the start reads the store's, the fill follows
    first = cache.fill_adapter(kept)
    assert not first.hit and first.cache_dir == cache.root / adapter_key(kept.adapter_id)
    assert read_manifest(first.cache_dir) == kept
    assert (first.cache_dir / ADAPTER_WEIGHTS).read_bytes() == (Path(kept.path) / ADAPTER_WEIGHTS).read_bytes()
    assert cache.used_bytes == sum((Path(kept.path) / f).stat().st_size for f in ADAPTER_FILES)

    uses = cache.entries[adapter_key(kept.adapter_id)].uses
    again = cache.verify_adapter(kept)
    assert again is not None and again.hit and again.repaired_blocks == 0
    assert cache.entries[adapter_key(kept.adapter_id)].uses == uses + 1

    # A flipped byte in host memory is found by the manifest's SHA-256 and copied again.
    weights = bytearray((first.cache_dir / ADAPTER_WEIGHTS).read_bytes())
    weights[-1] ^= 0xFF
    (first.cache_dir / ADAPTER_WEIGHTS).write_bytes(bytes(weights))
    repaired = cache.verify_adapter(kept)
    assert repaired is not None and repaired.hit and repaired.repaired_blocks == 1
    assert hashlib.sha256((repaired.cache_dir / ADAPTER_WEIGHTS).read_bytes()).hexdigest() == kept.sha256

    # A store copy that no longer matches its manifest is refused, nothing left in the cache.
    cache.evict(adapter_key(kept.adapter_id))
    (Path(kept.path) / ADAPTER_WEIGHTS).write_bytes(bytes(weights))
    with pytest.raises(RuntimeError, match="SHA-256"):
        cache.fill_adapter(kept)
    assert list(cache.root.iterdir()) == [] and cache.used_bytes == 0

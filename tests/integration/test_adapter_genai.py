"""What the loader keeps of an adapter is what OpenVINO GenAI applies (issue 34): the checked
copy of a PEFT adapter (`services/loader/adapters.py`) read by `openvino_genai.Adapter`, applied
at the manifest's `scale` as the adapter's alpha, gives PEFT's own greedy tokens on the same
checkpoint; at alpha 1 (the raw B·A) it does not. The contract the engine's adapter support
builds on, checked without the engine.

The checkpoint is exported at f32 and compiled with f32 inference and KV cache: OpenVINO's CPU
plugin would otherwise compute in bf16 where the CPU has it, and what is compared is the
adapter's application, not the plugin's precision (as in test_hf_export.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from services.loader.adapters import import_adapter
from shared.adapters import ADAPTER_WEIGHTS
from shared.messages import Artifact, ModelRecord, SourceFormat
from tests.helpers.adapters import make_adapter
from tests.helpers.checkpoints import export_ir, make_tiny_checkpoint

PROMPT = "What is the capital of France?"
TOKENS = 12


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"))


def _base(ir: Path) -> ModelRecord:
    artifact = Artifact(
        artifact_id="tiny-f32",
        path=str(ir),
        source_sha256="0" * 64,
        context_length=8192,
        kv_bytes_per_token=1,
        weight_bytes=1,
        source_format=SourceFormat.HF,
    )
    return ModelRecord(
        name="tiny", source=str(ir), artifact=artifact, ttft_slo_s=2, tpot_slo_s=0.1, keep_alive_s=60, created_at=0
    )


def _peft_greedy(checkpoint: Path, adapter: Path | None) -> tuple[list[int], list[int]]:
    """The prompt's ids and PEFT's (or, without an adapter, transformers') greedy tokens."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ids = AutoTokenizer.from_pretrained(checkpoint)(PROMPT, return_tensors="pt").input_ids
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter).eval()
    with torch.no_grad():
        out = model.generate(input_ids=ids, max_new_tokens=TOKENS, do_sample=False)
    return ids[0].tolist(), out[0, ids.shape[1] :].tolist()


def test_the_kept_adapter_at_its_manifest_scale_gives_pefts_greedy_tokens(checkpoint: Path, tmp_path: Path) -> None:
    import numpy as np
    import openvino as ov
    import openvino_genai as ov_genai

    ir = export_ir(checkpoint, tmp_path / "ir", "f32")
    source = make_adapter(checkpoint, tmp_path / "adapter", seed=3)
    kept = import_adapter(_base(ir), source, max_rank=64).adapter
    assert kept.scale == 2.0  # lora_alpha 16 over rank 8

    ids, base_tokens = _peft_greedy(checkpoint, None)
    _, lora_tokens = _peft_greedy(checkpoint, source)
    assert lora_tokens != base_tokens  # the adapter changes the greedy output

    adapter = ov_genai.Adapter(str(Path(kept.path) / ADAPTER_WEIGHTS))
    pipe = ov_genai.LLMPipeline(
        str(ir),
        "CPU",
        adapters=ov_genai.AdapterConfig(adapter),
        INFERENCE_PRECISION_HINT="f32",
        KV_CACHE_PRECISION="f32",
    )

    def greedy(adapters: ov_genai.AdapterConfig) -> list[int]:
        config = ov_genai.GenerationConfig(max_new_tokens=TOKENS, do_sample=False)
        config.adapters = adapters
        result = pipe.generate(ov.Tensor(np.array([ids], dtype=np.int64)), config)
        return [int(t) for t in result.tokens[0]]

    assert greedy(ov_genai.AdapterConfig()) == base_tokens
    assert greedy(ov_genai.AdapterConfig(adapter, kept.scale)) == lora_tokens
    assert greedy(ov_genai.AdapterConfig(adapter, 1.0)) != lora_tokens

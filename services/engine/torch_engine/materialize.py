"""A torch-loadable checkpoint from a GGUF, made once at registration (MEDUSA §4: materialize
what a start would otherwise redo).

transformers reads a GGUF's config, tokenizer and (dequantized) tensors; this writes them as a
checkpoint any torch engine loads (`config.json`, `model.safetensors`, the tokenizer's files)
plus `manifest.json`: every tensor's content digest, dtype and shape in access order, so that a
start knows which tensors the arena already holds before it reads a byte of the file.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoConfig, AutoTokenizer
from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

from cuda_ext import content_digests
from services.engine.torch_engine.binding import skeleton

MANIFEST = "manifest.json"
WEIGHTS = "model.safetensors"


def materialize(gguf: Path, dest: Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write `gguf`'s model to `dest` in `dtype` (bf16 for a GPU, float32 for the host's
    matmuls); returns `dest`. ≈ 20 s for SmolLM2-135M's Q4_1 GGUF on this 2-core machine."""
    dest.mkdir(parents=True, exist_ok=True)
    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # Without accelerate, `from_pretrained(gguf_file=...)` refuses; the reader underneath it
    # needs only the model's skeleton to name and shape the tensors.
    model = skeleton(config, dtype)
    raw = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=model)["tensors"]
    # The skeleton declares a decoder's parameters in the order its forward reads them.
    names = [n for n, _ in model.named_parameters() if n in raw]
    tensors = {n: raw[n].to(dtype).contiguous() for n in names}
    save_file(tensors, str(dest / WEIGHTS), metadata={"format": "pt"})
    config.torch_dtype = dtype
    config.save_pretrained(dest)
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(dest)
    digests = content_digests(tensors)
    manifest = {
        "source": gguf.name,
        "dtype": str(dtype).removeprefix("torch."),
        "tensors": [
            {"name": n, "digest": digests[n], "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}
            for n, t in tensors.items()
        ],
    }
    (dest / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return dest

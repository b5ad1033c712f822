"""A torch-loadable checkpoint from a GGUF, made once at registration (MEDUSA §4: materialize
what a start would otherwise redo) where the node's engine is torch (`engine_backend`).

transformers reads a GGUF's config, tokenizer and (dequantized) tensors; this writes them as a
checkpoint any torch engine loads (`config.json`, `model.safetensors`, the tokenizer's files)
plus `manifest.json`: every tensor's content digest, dtype and shape in access order, so that a
start knows which tensors the arena already holds before it reads a byte of the file.

torch and transformers are imported by the converter process only when it writes one, so an
OpenVINO node needs neither.
"""

from __future__ import annotations

import json
import shutil
import struct
import tempfile
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

from cuda_ext import content_digests
from shared.artifact import NORM, TORCH_MANIFEST, TORCH_WEIGHTS


def host_dtype() -> torch.dtype:
    """bf16 where the node has CUDA (the GPU's matmuls), float32 on the host (bf16 has no fast
    path on this CPU: the torch engine's e2e tests measured it several times slower)."""
    return torch.bfloat16 if torch.cuda.is_available() else torch.float32


def from_hf(checkpoint: Path, dest: Path, dtype: torch.dtype) -> Path:
    """A Hugging Face checkpoint directory's weights as they are (in `dtype`), in the forward
    pass's order with their manifest, and its config and tokenizer, into `dest`."""
    from safetensors.torch import load_file

    config = AutoConfig.from_pretrained(checkpoint)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    raw: dict[str, torch.Tensor] = {}
    for shard in sorted(checkpoint.glob("*.safetensors")):
        raw.update(load_file(shard))
    names = [n for n, _ in model.named_parameters() if n in raw]
    tensors = {n: raw[n].to(dtype).contiguous() for n in names}
    return write_checkpoint(dest, tensors, config, AutoTokenizer.from_pretrained(checkpoint), checkpoint.name)


def materialize(gguf: Path, dest: Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write `gguf`'s model (or a Hugging Face checkpoint directory's: `from_hf`) to `dest` in
    `dtype`; returns `dest`. ≈ 20 s for SmolLM2-135M's Q4_1 GGUF on this 2-core machine."""
    if gguf.is_dir():
        return from_hf(gguf, dest, dtype)
    dest.mkdir(parents=True, exist_ok=True)
    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # Without accelerate, `from_pretrained(gguf_file=...)` refuses; the reader underneath it
    # needs only the model's skeleton, on the meta device (no memory), to name and shape the tensors.
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    raw = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=model)["tensors"]
    # The skeleton declares a decoder's parameters in the order its forward reads them.
    names = [n for n, _ in model.named_parameters() if n in raw]
    tensors = {n: raw[n].to(dtype).contiguous() for n in names}
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    return write_checkpoint(dest, tensors, config, tokenizer, gguf.name)


_DTYPES = {
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


def save_in_order(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str]) -> None:
    """A safetensors file with the tensors' bytes in `tensors`' order. `safetensors.save_file`
    lays them out sorted by dtype and name ("layers.10" before "layers.2"); this keeps the
    forward pass's order, so that the file's first bytes are its first layers: a multicast's
    chunks (FaaScale Algorithm 1) are then layer ranges a pipeline stage can run, and a start
    streaming layers reads the file front to back. Same format (header, then the data with no
    gaps): every safetensors reader reads it."""
    header: dict[str, Any] = {"__metadata__": metadata}
    at = 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        header[name] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [at, at + n]}
        at += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as save_file pads it
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for t in tensors.values():
            f.write(t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())


def write_checkpoint(dest: Path, tensors: dict[str, torch.Tensor], config: Any, tokenizer: Any, source: str) -> Path:
    """Write a checkpoint of `tensors` (in the order the forward pass reads them) to `dest`:
    weights, config, tokenizer and the manifest of digests; returns `dest`."""
    dest.mkdir(parents=True, exist_ok=True)
    dtype = next(iter(tensors.values())).dtype
    # The final norm (a few KB) first: it lands in the blocks every pipeline stage reads
    # first (`services/loader/layout.py`), so a tied head, the norm and the embedding, can run
    # on the node holding the first layers before the last ones arrive. The rest: forward order.
    in_file = {n: tensors[n] for n in sorted(tensors, key=lambda n: n != NORM)}
    save_in_order(in_file, dest / TORCH_WEIGHTS, metadata={"format": "pt"})
    config.torch_dtype = dtype
    config.save_pretrained(dest)
    tokenizer.save_pretrained(dest)
    digests = content_digests(tensors)
    manifest = {
        "source": source,
        "dtype": str(dtype).removeprefix("torch."),
        "tensors": [
            {"name": n, "digest": digests[n], "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}
            for n, t in tensors.items()
        ],
    }
    (dest / TORCH_MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return dest


def materialize_into(gguf: Path, final: Path, dtype: torch.dtype) -> None:
    """`materialize` into a temporary sibling renamed into place: a crash never leaves a
    checkpoint that looks whole to `shared.artifact.has_torch_checkpoint`."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=final.parent))
    try:
        materialize(gguf, tmp, dtype)
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

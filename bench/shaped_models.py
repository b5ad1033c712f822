"""GGUF models of real sizes with random weights and the real default model's tokenizer.

Every mechanism was measured on SmolLM2-135M only; the sizes people run (1.7B, 7-8B) are
made here: a Llama-architecture GGUF of the given shape whose tokenizer metadata (vocabulary,
merges, special tokens, chat template) is copied from the real SmolLM2-135M-Instruct GGUF, so
prompts tokenize and generated ids decode exactly as on the real model. The weight layout
mirrors that file's: Q8_0 token embeddings (tied: no `output.weight`), Q4_1 matmuls, F32
norms; OpenVINO GenAI's GGUF reader takes exactly these.

Weights are random (a fixed seed: the same bytes every time), scaled like an initialised
model (std ≈ 0.02) so activations stay finite; greedy output is noise, but every matmul
reads the same bytes a real model of that shape would.

The same model in Hugging Face form (`hf_form`: safetensors in bf16, `config.json`, the
tokenizer) is read from that GGUF by transformers' own GGUF reader, so both forms hold the same
weights (the 4-bit values dequantized); for the real 135M it is the real model's weights.

`python -m bench.shaped_models --shape smollm2-1.7b [--form hf]` writes it once into
`~/.cache/tessera/shaped/` (or `$TESSERA_SHAPED_DIR`) and prints its path.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

from ops.localcluster import default_model_path

Q4_1 = gguf.GGMLQuantizationType.Q4_1
Q8_0 = gguf.GGMLQuantizationType.Q8_0
F32 = gguf.GGMLQuantizationType.F32
INIT_STD = 0.02
SEED = 20261127


@dataclass(frozen=True)
class Shape:
    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    rope_base: float
    vocab: int = 49152
    context: int = 8192

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def matrices(self) -> list[tuple[str, int, int]]:
        """(name, rows, columns) of every quantized matrix, in the real file's order (rows:
        output features; GGUF stores the shape reversed)."""
        h, kv = self.hidden, self.kv_heads * self.head_dim
        out = [("token_embd.weight", self.vocab, h)]
        for i in range(self.layers):
            b = f"blk.{i}"
            out += [
                (f"{b}.ffn_down.weight", h, self.intermediate),
                (f"{b}.ffn_gate.weight", self.intermediate, h),
                (f"{b}.ffn_up.weight", self.intermediate, h),
                (f"{b}.attn_k.weight", kv, h),
                (f"{b}.attn_output.weight", h, h),
                (f"{b}.attn_q.weight", h, h),
                (f"{b}.attn_v.weight", kv, h),
            ]
        return out

    @property
    def params(self) -> int:
        return sum(r * c for _, r, c in self.matrices()) + (2 * self.layers + 1) * self.hidden


SHAPES = {
    s.name: s
    for s in (
        # SmolLM2-360M's config.json: a point between the real 135M and 1.7B.
        Shape("smollm2-360m", hidden=960, layers=32, heads=15, kv_heads=5, intermediate=2560, rope_base=100000.0),
        # SmolLM2-1.7B's config.json.
        Shape("smollm2-1.7b", hidden=2048, layers=24, heads=32, kv_heads=32, intermediate=8192, rope_base=130000.0),
        # Llama-3-8B's body on SmolLM2's vocabulary (so its tokens decode): ≈ 7.2B parameters.
        Shape("llama3-8b", hidden=4096, layers=32, heads=32, kv_heads=8, intermediate=14336, rope_base=500000.0),
    )
}
REAL = "smollm2-135m"
"""The real default model (its own file, not a shaped one)."""


def cache_dir() -> Path:
    return Path(os.environ.get("TESSERA_SHAPED_DIR", Path.home() / ".cache" / "tessera" / "shaped"))


def shaped_path(name: str) -> Path:
    return cache_dir() / f"{name}.Q4_1.gguf"


def _quantized(rng: np.random.Generator, rows: int, cols: int, qtype: gguf.GGMLQuantizationType) -> np.ndarray:
    """Random blocks of `qtype` with values of std ≈ INIT_STD, as (rows, bytes) uint8."""
    blocks = rows * cols // 32
    if qtype == Q4_1:  # f16 scale d, f16 min m, 16 bytes of nibbles; value = d * q + m, q in 0..15
        d = INIT_STD / 4.6  # a uniform 0..15 has std ≈ 4.6
        head = np.array([d, -7.5 * d], dtype=np.float16).view(np.uint8)
        body = rng.integers(0, 256, size=(blocks, 16), dtype=np.uint8)
    else:  # Q8_0: f16 scale d, 32 signed bytes; value = d * q
        d = INIT_STD / 73.0  # a uniform -127..127 has std ≈ 73
        head = np.array([d], dtype=np.float16).view(np.uint8)
        body = rng.integers(-127, 128, size=(blocks, 32), dtype=np.int8).view(np.uint8)
    out = np.concatenate([np.broadcast_to(head, (blocks, head.size)), body], axis=1)
    return out.reshape(rows, -1)


def _copy_tokenizer(reader: gguf.GGUFReader, writer: gguf.GGUFWriter) -> None:
    """The real file's tokenizer.* key-value pairs, typed as they are there."""
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        vtype = field.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            writer.add_key_value(key, field.contents(), vtype, sub_type=field.types[-1])
        else:
            writer.add_key_value(key, field.contents(), vtype)


def write_shaped(shape: Shape, dest: Path) -> None:
    """Write the GGUF of `shape` to `dest`, streaming one tensor at a time (a 7B's 4.6 GB
    never sits in memory whole)."""
    arch = "llama"
    writer = gguf.GGUFWriter(str(dest), arch)
    writer.add_name(f"tessera shaped {shape.name} (random weights)")
    writer.add_block_count(shape.layers)
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.hidden)
    writer.add_feed_forward_length(shape.intermediate)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_rope_freq_base(shape.rope_base)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_1)
    writer.add_vocab_size(shape.vocab)
    writer.add_rope_dimension_count(shape.head_dim)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    _copy_tokenizer(gguf.GGUFReader(str(default_model_path())), writer)

    # Tensor infos first (the header needs every one), then the data in the same order.
    order: list[tuple[str, int, int, gguf.GGMLQuantizationType]] = []
    for name, rows, cols in shape.matrices():
        qtype = Q8_0 if name == "token_embd.weight" else Q4_1
        order.append((name, rows, cols, qtype))
        if name.endswith("attn_v.weight"):
            layer = name.rsplit(".", 2)[0]
            order += [
                (f"{layer}.attn_norm.weight", 1, shape.hidden, F32),
                (f"{layer}.ffn_norm.weight", 1, shape.hidden, F32),
            ]
    order.append(("output_norm.weight", 1, shape.hidden, F32))
    for name, rows, cols, qtype in order:
        if qtype == F32:
            writer.add_tensor_info(name, (cols,), np.dtype(np.float32), cols * 4)
        else:
            block_bytes = gguf.GGML_QUANT_SIZES[qtype][1]
            nbytes = rows * cols // 32 * block_bytes
            writer.add_tensor_info(name, (rows, cols // 32 * block_bytes), np.dtype(np.uint8), nbytes, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(SEED)
    for _name, rows, cols, qtype in order:
        data = np.ones(cols, dtype=np.float32) if qtype == F32 else _quantized(rng, rows, cols, qtype)
        writer.write_tensor_data(data)
    writer.close()


def ensure(name: str) -> Path:
    """The GGUF of shape `name` (the real file for `smollm2-135m`), written once."""
    if name == REAL:
        return default_model_path()
    path = shaped_path(name)
    if path.is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}-", dir=path.parent)
    os.close(fd)
    try:
        write_shaped(SHAPES[name], Path(tmp))
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)  # whole or absent: a crash never leaves a file that looks done
    finally:
        Path(tmp).unlink(missing_ok=True)
    return path


def hf_form(name: str) -> Path:
    """The Hugging Face checkpoint directory of `name`, written once from its GGUF."""
    dest = cache_dir() / f"{name}-hf"
    if (dest / "config.json").is_file():
        return dest
    gguf_path = ensure(name)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}-", dir=cache_dir()))
    try:
        _write_hf(gguf_path, tmp)
        shutil.rmtree(dest, ignore_errors=True)
        os.replace(tmp, dest)  # config.json last in, whole directory in at once
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def _write_hf(gguf_path: Path, dest: Path) -> None:
    """transformers' GGUF reader (config, dequantized tensors) into a model built on the meta
    device, saved in bf16 as checkpoints on the hub are; the tokenizer as a checkpoint holds it.
    (`from_pretrained(gguf_file=...)` would do the same but needs `accelerate`.)"""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from tests.helpers.checkpoints import save_default_tokenizer

    config = AutoConfig.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    tensors = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=model)["tensors"]
    model.load_state_dict({k: v.to(torch.bfloat16) for k, v in tensors.items()}, strict=False, assign=True)
    del tensors
    model.tie_weights()
    unset = [n for n, p in model.named_parameters() if p.is_meta]
    if unset:
        raise RuntimeError(f"the GGUF left {len(unset)} parameters unset: {unset[:5]}")
    model.save_pretrained(dest, safe_serialization=True)
    save_default_tokenizer(dest)


def params_of(name: str) -> int:
    """Parameter count of a shape (the real 135M counted from its file)."""
    if name in SHAPES:
        return SHAPES[name].params
    reader = gguf.GGUFReader(str(default_model_path()))
    return int(sum(int(t.n_elements) for t in reader.tensors))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=[REAL, *SHAPES], required=True)
    parser.add_argument("--form", choices=["gguf", "hf"], default="gguf")
    args = parser.parse_args()
    print(hf_form(args.shape) if args.form == "hf" else ensure(args.shape))


if __name__ == "__main__":
    main()

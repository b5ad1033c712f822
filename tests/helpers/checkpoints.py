"""Model directories for tests of registration formats (no hub here): a tiny Hugging Face
checkpoint (the real default model's tokenizer, a Llama of a few layers with random weights),
and an OpenVINO IR directory exported from it by the loader's exporter."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from ops.localcluster import default_model_path

IM_END = "<|im_end|>"
TINY_SEED = 0
CONTEXT_LENGTH = 8192
"""The default model's (SmolLM2-135M's `max_position_embeddings`), which the tiny one keeps."""


def save_default_tokenizer(dest: Path) -> Any:
    """SmolLM2-135M-Instruct's tokenizer, read from the default GGUF by transformers, saved in
    `dest` as a Hugging Face checkpoint holds it; returns it."""
    from transformers import AutoTokenizer

    gguf = default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # Where transformers' reading of the GGUF's tokenizer departs from the checkpoint published
    # on the hub (HuggingFaceTB/SmolLM2-135M-Instruct): the chat's end is its end of sequence,
    # and its decoder is plain byte-level (the reader's ByteFallback + Fuse sequence is one
    # openvino_tokenizers cannot convert).
    tokenizer.eos_token = IM_END
    tokenizer.save_pretrained(dest)
    spec = dest / "tokenizer.json"
    raw = json.loads(spec.read_text())
    raw["decoder"] = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True}
    spec.write_text(json.dumps(raw, ensure_ascii=False))
    return tokenizer


def make_tiny_checkpoint(dest: Path, dtype: str = "float32") -> Path:
    """A Llama of the default model's tokenizer and vocabulary but a tiny shape (hidden 64,
    2 layers, 4 heads over 2 KV heads; ≈ 3.2 M parameters, nearly all the tied embedding), its
    weights random from a fixed seed (and a wider `initializer_range`: below), saved as
    safetensors: what registration and export do to a checkpoint, in seconds rather than the
    minutes the 135 M model's export takes. Random weights: its greedy text is not language,
    but it is the same for the same weights. `dtype`: the checkpoint's (`bfloat16`, as most on the
    hub are, or `float32`)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = save_default_tokenizer(dest)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=CONTEXT_LENGTH,
        tie_word_embeddings=True,
        # At transformers' default (0.02) the layers add little to the residual stream, and a
        # tied head's best token is then the last one read: the greedy text repeats the prompt's
        # last token ("\n" after a chat template), which would make two forms' texts equal
        # whatever they compute. At 0.2 each new token depends on the context.
        initializer_range=0.2,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(TINY_SEED)
    model = LlamaForCausalLM(config).to(getattr(torch, dtype))
    model.save_pretrained(dest, safe_serialization=True)
    return dest


def export_ir(checkpoint: Path, dest: Path, weight_format: str) -> Path:
    """`checkpoint` exported as `optimum-cli export openvino --weight-format` would (the
    loader's exporter: `services/loader/hf_export.py`), in a process of its own: the trace's
    warnings are errors in the test process (pytest's `filterwarnings`)."""
    subprocess.run(
        [sys.executable, "-m", "services.loader.hf_export", str(checkpoint), str(dest), weight_format],
        check=True,
        timeout=600,
        capture_output=True,
    )
    return dest

"""Model directories made from the real default model, for tests of registration formats
(no hub here): a Hugging Face checkpoint read from the GGUF by transformers, and an OpenVINO IR
directory exported from that checkpoint by the loader's exporter."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from ops.localcluster import default_model_path

IM_END = "<|im_end|>"


def make_hf_checkpoint(dest: Path) -> Path:
    """SmolLM2-135M-Instruct as a Hugging Face checkpoint in `dest`: the GGUF's tensors
    dequantized by transformers (float32, so they are the GGUF's values exactly), its config and
    tokenizer. ≈ 35 s here."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    gguf = default_model_path()
    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # `from_pretrained(gguf_file=...)` wants accelerate, which the project does not install:
    # the same reader, on a model built from the config.
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=model)["tensors"]
    model.load_state_dict({k: v.float() for k, v in tensors.items()}, strict=False)  # lm_head: tied
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # Where transformers' reading of the GGUF's tokenizer departs from the checkpoint published
    # on the hub (HuggingFaceTB/SmolLM2-135M-Instruct): the chat's end is its end of sequence,
    # and its decoder is plain byte-level (the reader's ByteFallback + Fuse sequence is one
    # openvino_tokenizers cannot convert).
    tokenizer.eos_token = IM_END
    model.save_pretrained(dest)
    tokenizer.save_pretrained(dest)
    spec = dest / "tokenizer.json"
    raw = json.loads(spec.read_text())
    raw["decoder"] = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True}
    spec.write_text(json.dumps(raw, ensure_ascii=False))
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

"""LoRA adapters for tests (issue 34): PEFT adapters made here on the tiny Hugging Face
checkpoint (`checkpoints.make_tiny_checkpoint`), saved as PEFT saves them
(`adapter_config.json` + `adapter_model.safetensors`).

PEFT initialises every `lora_B` to zero, so that a fresh adapter computes exactly its base:
useless for a test that an adapter is applied. Here every LoRA matrix is drawn from a fixed
seed instead, at a scale that moves the tiny model's greedy choice, so that the base's and an
adapter's greedy texts differ (and two adapters of different seeds differ from each other)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

LLAMA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""Every linear of a Llama decoder layer: what an adapter may target on such a base."""

LORA_SCALE = 0.5
"""Standard deviation of the drawn LoRA matrices: with rank 8 and alpha 16 (a scaling of 2),
the low-rank update's entries are of the order of the tiny model's own weights (drawn at 0.2,
`checkpoints.make_tiny_checkpoint`), enough to change which token is greedy."""


def make_adapter(
    base: Path,
    dest: Path,
    *,
    seed: int = 1,
    rank: int = 8,
    alpha: int = 16,
    targets: Sequence[str] = ("q_proj", "v_proj"),
) -> Path:
    """A PEFT LoRA adapter of `rank` on `targets` of the checkpoint at `base`, its A and B
    matrices drawn from `seed`, saved in `dest` (created)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets), lora_dropout=0.0, bias="none")
    peft_model = get_peft_model(model, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * LORA_SCALE)
    dest.mkdir(parents=True, exist_ok=True)
    peft_model.save_pretrained(str(dest), safe_serialization=True)
    return dest


def write_adapter(
    base: Path,
    dest: Path,
    *,
    seed: int = 1,
    rank: int = 8,
    alpha: int = 16,
    targets: Sequence[str] = ("q_proj", "v_proj"),
) -> Path:
    """The same kind of adapter as `make_adapter`, written without PEFT (a vLLM node's
    environment has none): PEFT's file layout and config, each matrix shaped from the base's
    config.json, drawn from `seed` at `LORA_SCALE`."""
    import json

    import torch
    from safetensors.torch import save_file

    config = json.loads((base / "config.json").read_text())
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    kv = config.get("num_key_value_heads", heads) * head_dim
    inter = config["intermediate_size"]
    shapes = {  # (in, out) of each linear
        "q_proj": (hidden, heads * head_dim),
        "k_proj": (hidden, kv),
        "v_proj": (hidden, kv),
        "o_proj": (heads * head_dim, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for t in targets:
            n_in, n_out = shapes[t]
            block = "mlp" if t in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            prefix = f"base_model.model.model.layers.{layer}.{block}.{t}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn((rank, n_in), generator=generator) * LORA_SCALE
            tensors[f"{prefix}.lora_B.weight"] = torch.randn((n_out, rank), generator=generator) * LORA_SCALE
    dest.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(dest / "adapter_model.safetensors"))
    peft_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": alpha,
        "target_modules": list(targets),
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "base_model_name_or_path": str(base),
    }
    (dest / "adapter_config.json").write_text(json.dumps(peft_config))
    return dest


def merged_greedy(base: Path, adapter: Path | None, prompt_ids: Sequence[int], tokens: int) -> list[int]:
    """transformers' greedy tokens of the checkpoint at `base` with the adapter's update merged
    into its weights (W + alpha/r · B·A, PEFT's function of a plain LoRA), or of the base alone."""
    import json

    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if adapter is not None:
        config = json.loads((adapter / "adapter_config.json").read_text())
        scale = config["lora_alpha"] / config["r"]
        weights = load_file(str(adapter / "adapter_model.safetensors"))
        modules = dict(model.named_modules())
        with torch.no_grad():
            for name, a in weights.items():
                if name.endswith(".lora_A.weight"):
                    prefix = name.removesuffix(".lora_A.weight")
                    b = weights[f"{prefix}.lora_B.weight"]
                    modules[prefix.removeprefix("base_model.model.")].weight += scale * (b @ a)
    ids = torch.tensor([list(prompt_ids)])
    out = model.generate(ids, max_new_tokens=tokens, do_sample=False, repetition_penalty=1.0)  # type: ignore[misc]
    return [int(t) for t in out[0][ids.shape[1] :]]

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

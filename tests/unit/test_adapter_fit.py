"""Whether a LoRA adapter fits its base (`policy/adapters.py`), on hand-made configs and
safetensors headers: each misfit refused with a reason that names it."""

from __future__ import annotations

import math
from typing import Any

import pytest

from policy.adapters import (
    AdapterRefused,
    BaseShape,
    TensorSpec,
    base_shape_from_config,
    base_shape_from_gguf,
    check_adapter,
    check_config,
)

# The tiny test checkpoint's shape (`tests/helpers/checkpoints.py`): hidden 64, 4 heads of 16
# over 2 KV heads (k/v project to 32), MLP 128, 2 layers.
BASE = BaseShape(architecture="llama", hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2, head_dim=16)
RANK = 8
CONFIG: dict[str, Any] = {
    "peft_type": "LORA",
    "r": RANK,
    "lora_alpha": 16,
    "target_modules": ["q_proj", "v_proj", "down_proj"],
    "bias": "none",
    "use_dora": False,
    "modules_to_save": None,
    "rank_pattern": {},
    "alpha_pattern": {},
}
MAX_RANK = 64


def key(layer: int, module: str, part: str) -> str:
    block = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
    return f"base_model.model.model.layers.{layer}.{block}.{module}.{part}.weight"


def tensors(shapes: dict[str, tuple[int, ...]] | None = None, dtype: str = "F32") -> tuple[dict[str, TensorSpec], int]:
    """A header's tensors laid end to end (and the data's length), from key → shape; by
    default a rank-8 adapter on q_proj, v_proj and down_proj of both layers of `BASE`."""
    if shapes is None:
        shapes = {}
        for layer in range(BASE.layers):
            for module in ("q_proj", "v_proj", "down_proj"):
                fan_in, fan_out = BASE.linears()[module]
                shapes[key(layer, module, "lora_A")] = (RANK, fan_in)
                shapes[key(layer, module, "lora_B")] = (fan_out, RANK)
    out, at = {}, 0
    size = {"F32": 4, "F16": 2, "BF16": 2}.get(dtype, 4)
    for name, shape in shapes.items():
        n = math.prod(shape) * size
        out[name] = TensorSpec(dtype, shape, (at, at + n))
        at += n
    return out, at


def refused(config: dict[str, Any] | None = None, shapes: dict[str, tuple[int, ...]] | None = None) -> str:
    found, nbytes = tensors(shapes)
    with pytest.raises(AdapterRefused) as e:
        check_adapter(config or CONFIG, found, nbytes, BASE, MAX_RANK)
    return str(e.value)


def test_an_adapter_that_fits_gives_its_rank_scale_targets_and_layers() -> None:
    found, nbytes = tensors()
    fit = check_adapter(CONFIG, found, nbytes, BASE, MAX_RANK)
    assert fit.rank == RANK and fit.alpha == 16.0 and fit.scale == 2.0
    assert fit.targets == ("q_proj", "v_proj", "down_proj")  # in the layer's order
    assert fit.layers == (0, 1) and fit.dtype == "F32"


def test_rslora_scales_by_the_square_root_of_the_rank() -> None:
    found, nbytes = tensors()
    fit = check_adapter({**CONFIG, "use_rslora": True}, found, nbytes, BASE, MAX_RANK)
    assert fit.scale == pytest.approx(16 / math.sqrt(RANK))


def test_kv_projections_are_sized_by_kv_heads_times_head_dim() -> None:
    shapes = {key(0, "k_proj", "lora_A"): (RANK, 64), key(0, "k_proj", "lora_B"): (64, RANK)}  # as if 4 KV heads
    message = refused({**CONFIG, "target_modules": ["k_proj"]}, shapes)
    assert "lora_B of layer 0 k_proj is 64×8" in message and "needs 32×8" in message


def test_a_rank_other_than_the_configs_is_refused() -> None:
    shapes = {key(0, "q_proj", "lora_A"): (4, 64), key(0, "q_proj", "lora_B"): (64, 4)}
    assert "lora_A of layer 0 q_proj is 4×64; rank 8 on this base needs 8×64" in refused(shapes=shapes)


def test_an_adapter_made_for_a_wider_base_is_refused() -> None:
    shapes = {key(0, "q_proj", "lora_A"): (RANK, 128), key(0, "q_proj", "lora_B"): (128, RANK)}
    assert "needs 8×64 (q_proj's input features)" in refused(shapes=shapes)


def test_an_mlp_adapter_is_checked_against_the_intermediate_size() -> None:
    shapes = {key(1, "down_proj", "lora_A"): (RANK, 256), key(1, "down_proj", "lora_B"): (64, RANK)}
    assert "needs 8×128 (down_proj's input features)" in refused(shapes=shapes)


def test_a_module_the_base_does_not_have_is_refused_by_name() -> None:
    bad = "base_model.model.model.layers.0.self_attn.qkv_proj.lora_A.weight"
    message = refused(shapes={bad: (RANK, 64)})
    assert "qkv_proj" in message and "does not have" in message


def test_the_embedding_or_head_is_not_a_target() -> None:
    message = refused(shapes={"base_model.model.lm_head.lora_A.weight": (RANK, 64)})
    assert "lm_head" in message and "not a LoRA A or B matrix of a decoder layer's linear" in message


def test_a_layer_past_the_bases_is_refused() -> None:
    shapes = {key(2, "q_proj", "lora_A"): (RANK, 64), key(2, "q_proj", "lora_B"): (64, RANK)}
    assert "layer 2, and the base has 2 layers" in refused(shapes=shapes)


def test_an_a_without_its_b_is_refused() -> None:
    assert "no lora_B for layer 0 q_proj" in refused(shapes={key(0, "q_proj", "lora_A"): (RANK, 64)})


def test_tensors_beyond_the_configs_targets_are_refused() -> None:
    message = refused({**CONFIG, "target_modules": ["q_proj"]})
    assert "its config names only q_proj" in message


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"peft_type": "PROMPT_TUNING"}, "not 'LORA'"),
        ({"use_dora": True}, "DoRA"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"rank_pattern": {"q_proj": 4}}, "rank_pattern"),
        ({"bias": "all"}, "trains biases"),
        ({"r": 0}, "not a positive integer"),
        ({"r": "8"}, "not a positive integer"),
        ({"r": 128}, "rank 128 is above this cluster's largest, 64"),
        ({"lora_alpha": -1}, "lora_alpha is -1"),
    ],
)
def test_configs_that_are_not_a_plain_lora_are_refused(change: dict[str, Any], says: str) -> None:
    with pytest.raises(AdapterRefused) as e:
        check_config({**CONFIG, **change}, MAX_RANK)
    assert says in str(e.value)


def test_an_architecture_without_the_llama_linears_is_refused() -> None:
    found, nbytes = tensors()
    phi = BaseShape(**{**BASE.__dict__, "architecture": "phi3"})
    with pytest.raises(AdapterRefused, match="adapters on a phi3 base are not supported"):
        check_adapter(CONFIG, found, nbytes, phi, MAX_RANK)


def test_a_truncated_file_is_refused() -> None:
    found, nbytes = tensors()
    with pytest.raises(AdapterRefused, match="truncated or corrupt"):
        check_adapter(CONFIG, found, nbytes - 4, BASE, MAX_RANK)


def test_integer_tensors_are_not_lora_matrices() -> None:
    found, nbytes = tensors(dtype="I32")
    with pytest.raises(AdapterRefused, match="is I32"):
        check_adapter(CONFIG, found, nbytes, BASE, MAX_RANK)


def test_an_empty_adapter_is_refused() -> None:
    with pytest.raises(AdapterRefused, match="no LoRA matrices"):
        check_adapter(CONFIG, {}, 0, BASE, MAX_RANK)


def test_the_bases_shape_from_a_hugging_face_config() -> None:
    config = {
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    }
    assert base_shape_from_config(config) == BASE
    # A multimodal config keeps its decoder apart; a head_dim given is taken as given.
    wrapped = {"model_type": "llava", "text_config": {**config, "head_dim": 32}}
    assert base_shape_from_config(wrapped).head_dim == 32
    with pytest.raises(AdapterRefused, match="no positive hidden_size"):
        base_shape_from_config({**config, "hidden_size": None})


def test_the_bases_shape_from_gguf_metadata() -> None:
    fields = {
        "general.architecture": "llama",
        "llama.embedding_length": 64,
        "llama.feed_forward_length": 128,
        "llama.block_count": 2,
        "llama.attention.head_count": 4,
        "llama.attention.head_count_kv": 2,
    }
    assert base_shape_from_gguf(fields) == BASE

"""Whether a PEFT LoRA adapter fits a base model (issue 34): the adapter's config and its
tensors' shapes against the base's shape. Pure: mappings in, facts or a refusal out (the
loader reads the files: `services/loader/adapters.py`).

An adapter of rank r on a linear `in → out` holds `lora_A` (r × in) and `lora_B` (out × r);
the update it adds is `scale · B·A` with `scale = lora_alpha / r` (`lora_alpha / √r` with
rsLoRA). Its keys are PEFT's: `base_model.model.<the module's path in the base>.lora_A.weight`.
Only the plain form is taken: no DoRA, no trained biases, no full modules saved beside
(`modules_to_save`), no per-module ranks, what every engine here (OpenVINO GenAI's `Adapter`,
vLLM, the torch engine's per-row update) applies alike.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

LLAMA_LIKE = frozenset({"llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2"})
"""Architectures whose decoder layers hold the seven linears of `BaseShape.linears` under
those names (`self_attn.{q,k,v,o}_proj`, `mlp.{gate,up,down}_proj`)."""

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
FLOAT_DTYPES = frozenset({"F32", "F16", "BF16"})
ITEMSIZE = {"F32": 4, "F16": 2, "BF16": 2}

_KEY = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.(lora_A|lora_B)\.weight$")

UNSUPPORTED = {
    "use_dora": "DoRA (use_dora)",
    "lora_bias": "trained LoRA biases (lora_bias)",
    "fan_in_fan_out": "fan_in_fan_out weights (GPT-2's Conv1D layout)",
    "modules_to_save": "full modules saved beside the adapter (modules_to_save)",
    "rank_pattern": "per-module ranks (rank_pattern)",
    "alpha_pattern": "per-module alphas (alpha_pattern)",
    "layer_replication": "replicated layers (layer_replication)",
    "trainable_token_indices": "trained token embeddings (trainable_token_indices)",
}
"""adapter_config.json keys whose set values ask for more than a plain LoRA update."""


class AdapterRefused(ValueError):
    """An adapter that does not fit its base (or is no LoRA adapter), with the reason the
    client is told."""


@dataclass(frozen=True)
class BaseShape:
    """What an adapter's shapes are checked against: a decoder's sizes."""

    architecture: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int

    def linears(self) -> dict[str, tuple[int, int]]:
        """Each LoRA-able linear of a layer by name, as (in features, out features)."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return {
            "q_proj": (self.hidden, q),
            "k_proj": (self.hidden, kv),
            "v_proj": (self.hidden, kv),
            "o_proj": (q, self.hidden),
            "gate_proj": (self.hidden, self.intermediate),
            "up_proj": (self.hidden, self.intermediate),
            "down_proj": (self.intermediate, self.hidden),
        }


@dataclass(frozen=True)
class TensorSpec:
    """A tensor as a safetensors header describes it."""

    dtype: str
    shape: tuple[int, ...]
    offsets: tuple[int, int]
    """[begin, end) in the file's data."""


@dataclass(frozen=True)
class AdapterFit:
    """What a fitting adapter is: its rank, the scale of its update, what it targets."""

    rank: int
    alpha: float
    scale: float
    """Its update's factor, `alpha / rank` (`alpha / √rank` with rsLoRA): what an engine that
    reads the raw A and B matrices multiplies their product by."""
    targets: tuple[str, ...]
    """The linears it updates (names of `BaseShape.linears`), sorted."""
    layers: tuple[int, ...]
    """The decoder layers it updates, sorted."""
    dtype: str


def _int(text: Mapping[str, Any], key: str) -> int:
    value = text.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise AdapterRefused(f"the base's config has no positive {key}")
    return value


def base_shape_from_config(config: Mapping[str, Any]) -> BaseShape:
    """A Hugging Face config.json's decoder (its `text_config` where it keeps one apart)."""
    text = config.get("text_config", config)
    if not isinstance(text, Mapping):
        raise AdapterRefused("the base's config.json has no decoder config")
    heads = _int(text, "num_attention_heads")
    hidden = _int(text, "hidden_size")
    head_dim = text.get("head_dim") or hidden // heads
    return BaseShape(
        architecture=str(text.get("model_type") or config.get("model_type", "")),
        hidden=hidden,
        intermediate=_int(text, "intermediate_size"),
        layers=_int(text, "num_hidden_layers"),
        heads=heads,
        kv_heads=int(text.get("num_key_value_heads") or heads),
        head_dim=int(head_dim),
    )


def base_shape_from_gguf(fields: Mapping[str, Any]) -> BaseShape:
    """A GGUF's metadata (`general.architecture`, `<arch>.embedding_length`, ...)."""
    arch = str(fields.get("general.architecture", ""))
    prefixed = {k.removeprefix(f"{arch}."): v for k, v in fields.items()}
    heads = _int(prefixed, "attention.head_count")
    hidden = _int(prefixed, "embedding_length")
    return BaseShape(
        architecture=arch,
        hidden=hidden,
        intermediate=_int(prefixed, "feed_forward_length"),
        layers=_int(prefixed, "block_count"),
        heads=heads,
        kv_heads=int(prefixed.get("attention.head_count_kv") or heads),
        head_dim=int(prefixed.get("attention.key_length") or hidden // heads),
    )


def check_config(config: Mapping[str, Any], max_rank: int) -> tuple[int, float, float]:
    """An adapter_config.json's rank, alpha and scale, or why it is not a plain LoRA adapter."""
    kind = config.get("peft_type")
    if kind != "LORA":
        raise AdapterRefused(f"adapter_config.json's peft_type is {kind!r}, not 'LORA': not a LoRA adapter")
    for key, what in UNSUPPORTED.items():
        if config.get(key):
            raise AdapterRefused(f"the adapter uses {what}, which adapters here do not support")
    if config.get("bias", "none") != "none":
        raise AdapterRefused(
            f"the adapter trains biases (bias={config.get('bias')!r}), which adapters here do not support"
        )
    rank = config.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank <= 0:
        raise AdapterRefused(f"adapter_config.json's rank r is {rank!r}, not a positive integer")
    if rank > max_rank:
        raise AdapterRefused(f"the adapter's rank {rank} is above this cluster's largest, {max_rank}")
    alpha = config.get("lora_alpha", rank)
    if not isinstance(alpha, int | float) or isinstance(alpha, bool) or not math.isfinite(alpha) or alpha <= 0:
        raise AdapterRefused(f"adapter_config.json's lora_alpha is {alpha!r}, not a positive number")
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return rank, float(alpha), scale


def check_adapter(
    config: Mapping[str, Any], tensors: Mapping[str, TensorSpec], data_bytes: int, base: BaseShape, max_rank: int
) -> AdapterFit:
    """Whether an adapter (its adapter_config.json, its safetensors header's tensors and the
    bytes of data after that header) fits `base`; `AdapterRefused` says why not."""
    rank, alpha, scale = check_config(config, max_rank)
    if base.architecture not in LLAMA_LIKE:
        raise AdapterRefused(
            f"adapters on a {base.architecture or 'unknown'} base are not supported "
            f"(supported: {', '.join(sorted(LLAMA_LIKE))})"
        )
    check_data(tensors, data_bytes)
    linears = base.linears()
    pairs: dict[tuple[int, str], dict[str, TensorSpec]] = {}
    for key, spec in tensors.items():
        m = _KEY.match(key)
        if m is None:
            raise AdapterRefused(f"tensor {key!r} is not a LoRA A or B matrix of a decoder layer's linear")
        layer, block, module, part = int(m[1]), m[2], m[3], m[4]
        if module not in linears or (block == "mlp") != (module in MLP):
            raise AdapterRefused(
                f"tensor {key!r} targets {block}.{module}, which a {base.architecture} base does not have "
                f"(its linears: {', '.join(linears)})"
            )
        if layer >= base.layers:
            raise AdapterRefused(f"tensor {key!r} is for layer {layer}, and the base has {base.layers} layers")
        pairs.setdefault((layer, module), {})[part] = spec
    if not pairs:
        raise AdapterRefused("the adapter's safetensors holds no LoRA matrices")
    dtypes = set()
    for (layer, module), parts in sorted(pairs.items()):
        where = f"layer {layer} {module}"
        if set(parts) != {"lora_A", "lora_B"}:
            missing = ({"lora_A", "lora_B"} - set(parts)).pop()
            raise AdapterRefused(f"the adapter has no {missing} for {where}")
        fan_in, fan_out = linears[module]
        a, b = parts["lora_A"].shape, parts["lora_B"].shape
        if a != (rank, fan_in):
            raise AdapterRefused(
                f"lora_A of {where} is {_dims(a)}; rank {rank} on this base needs {rank}×{fan_in} "
                f"({module}'s input features)"
            )
        if b != (fan_out, rank):
            raise AdapterRefused(
                f"lora_B of {where} is {_dims(b)}; rank {rank} on this base needs {fan_out}×{rank} "
                f"({module}'s output features)"
            )
        dtypes |= {parts["lora_A"].dtype, parts["lora_B"].dtype}
    if len(dtypes) != 1:
        raise AdapterRefused(f"the adapter mixes element types {sorted(dtypes)}")
    targets = tuple(sorted({module for _, module in pairs}, key=list(linears).index))
    named = config.get("target_modules")
    if isinstance(named, list | tuple) and not set(targets) <= set(named):
        raise AdapterRefused(
            f"the adapter's tensors target {', '.join(targets)}, and its config names only {', '.join(named)}"
        )
    return AdapterFit(
        rank=rank,
        alpha=alpha,
        scale=scale,
        targets=targets,
        layers=tuple(sorted({layer for layer, _ in pairs})),
        dtype=dtypes.pop(),
    )


def check_data(tensors: Mapping[str, TensorSpec], data_bytes: int) -> None:
    """Each tensor a float matrix whose bytes are where the header says, and the file as long
    as they are (a truncated or padded file is not what was saved)."""
    end = 0
    for key, spec in tensors.items():
        if spec.dtype not in FLOAT_DTYPES:
            raise AdapterRefused(f"tensor {key!r} is {spec.dtype}; a LoRA matrix is one of {sorted(FLOAT_DTYPES)}")
        if len(spec.shape) != 2:
            raise AdapterRefused(f"tensor {key!r} has shape {_dims(spec.shape)}; a LoRA matrix has two dimensions")
        begin, stop = spec.offsets
        if stop - begin != math.prod(spec.shape) * ITEMSIZE[spec.dtype] or begin < 0:
            raise AdapterRefused(f"tensor {key!r}'s bytes do not match its shape: the safetensors file is corrupt")
        end = max(end, stop)
    if end != data_bytes:
        raise AdapterRefused(
            f"the safetensors file holds {data_bytes} bytes of data where its header describes {end}: "
            "truncated or corrupt"
        )


def _dims(shape: tuple[int, ...]) -> str:
    return "×".join(str(d) for d in shape) or "a scalar"

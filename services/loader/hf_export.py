"""A Hugging Face checkpoint directory → an OpenVINO IR directory as `optimum-cli export
openvino` writes it: the stateful decoder (`openvino_model.xml/.bin`, its KV cache held as
state, a `beam_idx` input), the tokenizer and detokenizer models, and the checkpoint's
`config.json`, `generation_config.json` and tokenizer files beside them.

optimum-intel is the ecosystem's exporter, but its newest release (2.2.0) requires
transformers < 5.6 and fails to import with the transformers this project pins (5.17). So this
does what its `main_export` does, with the same libraries underneath: `openvino.convert_model`
traces the transformers model, OpenVINO's own make-stateful transformation hides the KV cache
(the pattern optimum-intel's `stateful.py` applies, which OpenVINO GenAI's pipelines expect),
NNCF's `compress_weights` keeps the weights in the registration's format, and
openvino_tokenizers' `convert_tokenizer` converts the tokenizer.
Runs in the converter's process (`convert.py`): torch, transformers and NNCF are imported only there.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import openvino as ov
import torch
from openvino import opset13 as ops

from services.loader.formats import NotImportable
from shared.messages import WeightFormat

EXPORT_FILES = ("config.json", "generation_config.json")


class _FlatCache(torch.nn.Module):
    """The model with its KV cache as plain tensors in and out (what a traced graph can hold):
    `past_key_values.<i>.key/value` in, `present.<i>.key/value` out."""

    def __init__(self, model: Any, layers: int) -> None:
        super().__init__()
        self.model = model
        self.layers = layers

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor, *past: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        from transformers import DynamicCache
        from transformers.cache_utils import DynamicLayer

        cache = DynamicCache(config=self.model.config)
        for i, layer in enumerate(cache.layers):
            if not isinstance(layer, DynamicLayer):  # a linear-attention (state-space) layer
                raise NotImportable(f"a {type(layer).__name__} cache layer, which the exporter cannot trace")
            # Filled in place: `update` on a fresh layer concatenates onto an empty 1-D tensor,
            # which the trace cannot convert (a Concat of ranks 1 and 4).
            layer.lazy_initialization(past[2 * i], past[2 * i + 1])
            layer.keys, layer.values = past[2 * i], past[2 * i + 1]
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=cache,
            use_cache=True,
        )
        flat: list[torch.Tensor] = []
        for i in range(self.layers):
            layer = out.past_key_values.layers[i]
            flat += [layer.keys, layer.values]
        return (out.logits, *flat)


def _trace(model: Any) -> ov.Model:
    config = model.config
    layers = int(config.num_hidden_layers)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
    batch, past_len, new = 2, 3, 2
    past = [torch.zeros(batch, kv_heads, past_len, head_dim, dtype=torch.float32) for _ in range(2 * layers)]
    example = (
        torch.ones(batch, new, dtype=torch.int64),
        torch.ones(batch, past_len + new, dtype=torch.int64),
        torch.arange(past_len, past_len + new, dtype=torch.int64).repeat(batch, 1),
        *past,
    )
    kv_names = [f"past_key_values.{i}.{kind}" for i in range(layers) for kind in ("key", "value")]
    names = ["input_ids", "attention_mask", "position_ids", *kv_names]
    shapes = [[-1, -1], [-1, -1], [-1, -1]] + [[-1, kv_heads, -1, head_dim]] * (2 * layers)
    with torch.no_grad():
        ov_model = ov.convert_model(
            _FlatCache(model, layers), example_input=example, input=[ov.PartialShape(s) for s in shapes]
        )
    for port, name in zip(ov_model.inputs, names, strict=True):
        port.get_tensor().set_names({name})
    outs = ["logits"] + [f"present.{i}.{kind}" for i in range(layers) for kind in ("key", "value")]
    for port, name in zip(ov_model.outputs, outs, strict=True):
        port.get_tensor().set_names({name})
    _make_stateful(ov_model, kv_names, outs[1:])
    return ov_model


def _make_stateful(ov_model: ov.Model, kv_inputs: list[str], kv_outputs: list[str]) -> None:
    """optimum-intel's `patch_stateful` for a decoder: a `beam_idx` input reorders the cache
    (a Gather on each cache input), then OpenVINO's transformation turns each cache input and
    output pair into a state, initialised to an empty cache of the batch's size."""
    from openvino._offline_transformations import apply_make_stateful_transformation

    beam_idx = ops.parameter(name="beam_idx", dtype=ov.Type.i32, shape=ov.PartialShape([-1]))
    beam_idx.output(0).get_tensor().add_names({"beam_idx"})
    ov_model.add_parameters([beam_idx])
    for name in kv_inputs:
        port = ov_model.input(name)
        consumers = port.get_target_inputs()
        gather = ops.gather(port, beam_idx, ops.constant(0))
        for consumer in consumers:
            consumer.replace_source_output(gather.output(0))
    ov_model.validate_nodes_and_infer_types()
    apply_make_stateful_transformation(ov_model, dict(zip(kv_inputs, kv_outputs, strict=True)))
    batch = ops.gather(ops.shape_of(ov_model.input("input_ids"), output_type="i64"), ops.constant([0]), ops.constant(0))
    for op in ov_model.get_ops():
        if op.get_type_name() == "ReadValue":
            dims: list[Any] = [d.min_length for d in op.get_output_partial_shape(0)]
            dims[0] = batch
            shape = ops.concat(
                [ops.constant(np.array([d], dtype=np.int64)) if isinstance(d, int) else d for d in dims], axis=0
            )
            op.set_arguments([ops.broadcast(ops.constant(0.0, dtype=op.get_output_element_type(0)), shape)])
    ov_model.validate_nodes_and_infer_types()


def _compress(ov_model: ov.Model, weight_format: WeightFormat) -> ov.Model:
    """NNCF's weight compression (data-free), as `optimum-cli --weight-format` asks for it."""
    if weight_format in (WeightFormat.F16, WeightFormat.F32):
        return ov_model  # `export` saves it with or without compress_to_fp16
    import nncf

    mode = {
        WeightFormat.INT8: nncf.CompressWeightsMode.INT8_ASYM,
        WeightFormat.INT4: nncf.CompressWeightsMode.INT4_ASYM,
    }[weight_format]
    return nncf.compress_weights(ov_model, mode=mode)


def _load_dtype(checkpoint: Path, weight_format: WeightFormat) -> torch.dtype:
    """The checkpoint's own 16-bit type where its weights are compressed to 8 or 4 bits anyway
    (NNCF reads them as they are); float32 where the IR keeps floating-point weights."""
    config = json.loads((checkpoint / "config.json").read_text())
    declared = config.get("dtype") or config.get("torch_dtype")  # transformers 5's key, then 4's
    sixteen = {"bfloat16": torch.bfloat16, "float16": torch.float16}
    if weight_format in (WeightFormat.INT8, WeightFormat.INT4) and declared in sixteen:
        return sixteen[declared]
    return torch.float32


def export(checkpoint: Path, out: Path, weight_format: WeightFormat) -> None:
    """Write the IR directory of `checkpoint` into `out` (created), its weights in `weight_format`."""
    from openvino_tokenizers import convert_tokenizer
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out.mkdir(parents=True, exist_ok=True)
    # The tokenizer first: it is seconds, the model minutes, and either may be refused.
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    tok, detok = convert_tokenizer(tokenizer, with_detokenizer=True, skip_special_tokens=True)
    ov.save_model(tok, str(out / "openvino_tokenizer.xml"))
    ov.save_model(detok, str(out / "openvino_detokenizer.xml"))
    model = AutoModelForCausalLM.from_pretrained(
        checkpoint, dtype=_load_dtype(checkpoint, weight_format), attn_implementation="sdpa"
    )
    model.eval()
    if model.dtype != torch.float32:
        # optimum-intel's way with a 16-bit checkpoint: its weights stay 16-bit constants in the
        # graph (no f32 copy: half the memory), and the trace runs placeholder matmuls.
        from openvino.frontend.pytorch.patch_model import __make_16bit_traceable as make_16bit_traceable

        make_16bit_traceable(model)
    ov_model = _compress(_trace(model), weight_format)
    del model
    ov.save_model(ov_model, str(out / "openvino_model.xml"), compress_to_fp16=weight_format != WeightFormat.F32)
    for name in EXPORT_FILES:
        if (checkpoint / name).is_file():
            shutil.copyfile(checkpoint / name, out / name)
    tokenizer.save_pretrained(out)


def main(argv: list[str]) -> None:
    """`python -m services.loader.hf_export CHECKPOINT OUT WEIGHT_FORMAT`: what
    `optimum-cli export openvino --weight-format` writes, by the loader's exporter."""
    checkpoint, out, weight_format = argv
    export(Path(checkpoint), Path(out), WeightFormat(weight_format))


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])

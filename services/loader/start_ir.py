"""The start tier of an artifact: the same weights, in a layout whose first pass is cheap.

OpenVINO's CPU plugin repacks a freshly imported model's weights during its first forward
pass. For 4-bit weights that repack is slow: measured here (SmolLM2-135M Q4_1, 2 cores) it is
0.35–0.6 s of every start from a compiled blob, more than llama.cpp's whole cold start. Holding
the same 4-bit values one per byte (u8 instead of u4, zero points and scales untouched) makes
the first pass 0.1–0.2 s, but decode reads more bytes per token and runs ≈ 16 % slower.

So a small artifact carries both (`start_tier_wins`: a large one only the packed tier, its
start served by the continuous-batching core): a start loads this tier, and the worker tiers up to the packed
4-bit one in the background once idle (a JIT's trick: run the cheap tier first, the fast one
when it is ready). The values are the same numbers, so the two tiers' logits are identical
(measured bit for bit on SmolLM2; tests check the values and that greedy
output is the same on both tiers).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import openvino as ov
from openvino import opset13 as ops

from shared.messages import WeightFormat


def start_tier_wins(weight_bytes: int, max_weight_bytes: int, weight_format: WeightFormat = WeightFormat.INT4) -> bool:
    """Whether an artifact whose packed weights take `weight_bytes` gets a start tier: only
    where they are at most `max_weight_bytes` (`LoaderSettings.start_tier_max_weight_bytes`,
    whose docstring has the measurements), and only for 4-bit weights: int8 or f16 weights
    have no u4 to widen, so a start tier would be a second copy of the same IR and blob."""
    return weight_format is WeightFormat.INT4 and weight_bytes <= max_weight_bytes


def _unpack_u4(const: ov.Node) -> np.ndarray:
    """A u4 constant's values, one per byte (OpenVINO packs two per byte, low nibble first)."""
    shape = tuple(const.get_output_shape(0))
    packed = np.asarray(const.data).reshape(-1)
    count = int(np.prod(shape))
    values = np.empty(packed.size * 2, dtype=np.uint8)
    values[0::2] = packed & 0x0F
    values[1::2] = packed >> 4
    return values[:count].reshape(shape)


def widen_u4_weights(model: ov.Model) -> int:
    """Replace every u4 constant by a u8 constant with the same values; returns how many."""
    widened = 0
    for node in model.get_ordered_ops():
        if node.get_type_name() != "Constant" or node.get_output_element_type(0) != ov.Type.u4:
            continue
        wide = ops.constant(_unpack_u4(node), dtype=ov.Type.u8)
        wide.set_friendly_name(node.get_friendly_name())
        for target in list(node.output(0).get_target_inputs()):
            target.replace_source_output(wide.output(0))
        widened += 1
    model.validate_nodes_and_infer_types()
    return widened


def write_start_ir(model_xml: Path, out_dir: Path) -> int:
    """Write the start tier of the IR at `model_xml` into `out_dir` (same file names)."""
    model = ov.Core().read_model(str(model_xml))
    widened = widen_u4_weights(model)
    out_dir.mkdir(parents=True, exist_ok=True)
    ov.save_model(model, str(out_dir / model_xml.name), compress_to_fp16=False)
    return widened

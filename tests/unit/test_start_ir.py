"""The start tier holds the same weights as the 4-bit IR: same values, so the same outputs."""

from __future__ import annotations

import numpy as np
import openvino as ov
from openvino import opset13 as ops

from services.loader.start_ir import widen_u4_weights, write_start_ir


def _compressed_matmul(seed: int, odd: bool = False) -> tuple[ov.Model, np.ndarray, np.ndarray]:
    """x @ dequant(w).T with w in u4 (per-group scale and zero point, as the GGUF reader
    builds it); `odd`: an odd element count, so the last byte holds half a pair."""
    rng = np.random.default_rng(seed)
    n, groups, group = (3, 1, 5) if odd else (8, 2, 16)
    q = rng.integers(0, 16, size=(n, groups, group), dtype=np.uint8)
    w = ops.constant(q, dtype=ov.Type.u4)
    zp = ops.constant(rng.integers(0, 16, size=(n, groups, 1)).astype(np.float16))
    scale = ops.constant(rng.random((n, groups, 1)).astype(np.float16))
    deq = ops.multiply(ops.subtract(ops.convert(w, ov.Type.f16), zp), scale)
    deq = ops.convert(ops.reshape(deq, ops.constant(np.array([n, groups * group])), False), ov.Type.f32)
    x = ops.parameter([1, groups * group], np.float32, name="x")
    model = ov.Model([ops.matmul(x, deq, False, True)], [x])
    expected = (q.astype(np.float32) - zp.data.astype(np.float32)) * scale.data.astype(np.float32)
    return model, q, expected.reshape(n, groups * group)


def _run(model: ov.Model, x: np.ndarray) -> np.ndarray:
    compiled = ov.Core().compile_model(model, "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
    return np.asarray(compiled.create_infer_request().infer({"x": x})[0])


def test_widening_keeps_every_value() -> None:
    for odd in (False, True):
        model, q, expected = _compressed_matmul(seed=1, odd=odd)
        x = np.random.default_rng(2).random((1, expected.shape[1]), dtype=np.float32)
        before = _run(model, x)
        assert widen_u4_weights(model) == 1
        consts = [n for n in model.get_ordered_ops() if n.get_type_name() == "Constant"]
        assert ov.Type.u4 not in {n.get_output_element_type(0) for n in consts}
        (wide,) = [n for n in consts if n.get_output_element_type(0) == ov.Type.u8]
        np.testing.assert_array_equal(np.asarray(wide.data), q)  # the same values, unpacked
        after = _run(model, x)
        # Kernels for u4 and u8 may sum in another order: equal up to f32 rounding.
        np.testing.assert_allclose(before, after, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(after[0], x[0] @ expected.T, rtol=1e-3)


def test_write_start_ir_round_trips(tmp_path) -> None:
    model, _, expected = _compressed_matmul(seed=3)
    ov.save_model(model, str(tmp_path / "openvino_model.xml"), compress_to_fp16=False)
    assert write_start_ir(tmp_path / "openvino_model.xml", tmp_path / "start") == 1
    x = np.ones((1, expected.shape[1]), dtype=np.float32)
    wide = ov.Core().read_model(str(tmp_path / "start" / "openvino_model.xml"))
    np.testing.assert_allclose(_run(model, x), _run(wide, x), rtol=1e-5, atol=1e-5)

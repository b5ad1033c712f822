"""What OpenVINO's model cache does for the continuous-batching core (issue 33's host-tier
start): a canary on the library, so that the day it changes, the core starts using it.

`services/engine/core.build_pipeline` compiles the core at every start: OpenVINO GenAI rewrites
the IR's attention into PagedAttention before compiling, and OpenVINO 2026.4's CPU plugin
writes that model's blob to a `CACHE_DIR` but cannot import it again (the PagedAttention
nodes' runtime info, `k_head_size` and `num_k_heads`, is not in the blob, and the import fails
the node's check), so it compiles again. The same IR without the rewrite imports from the
cache. When the second assertion below fails, the library imports a paged-attention blob:
give `build_pipeline` a `CACHE_DIR` in the artifact, written at registration, and a start from
the host cache skips the compile (1.6 of 1.7 s at 135 M here)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = pytest.mark.integration


def _compiled_from_cache(ir: Path, cache: Path, paged: bool) -> bool:
    import openvino as ov
    from openvino._offline_transformations import paged_attention_transformation

    core = ov.Core()
    model = core.read_model(ir / "openvino_model.xml")
    if paged:
        # As OpenVINO GenAI's continuous batching does before it compiles (no cache eviction,
        # rotation or sparse attention: `build_pipeline`'s scheduler).
        paged_attention_transformation(model, False, False, False, False, False)
    compiled = core.compile_model(model, "CPU", {"CACHE_DIR": str(cache), "INFERENCE_NUM_THREADS": 1})
    return bool(compiled.get_property("LOADED_FROM_CACHE"))


def test_a_paged_attention_model_is_compiled_again_where_the_plain_one_is_imported(
    tiny_ir_int8: Path, tmp_path: Path
) -> None:
    plain, paged = tmp_path / "plain", tmp_path / "paged"
    assert not _compiled_from_cache(tiny_ir_int8, plain, paged=False)
    assert _compiled_from_cache(tiny_ir_int8, plain, paged=False)  # the cache works here
    assert not _compiled_from_cache(tiny_ir_int8, paged, paged=True)
    assert any(paged.iterdir())  # its blob was written ...
    assert not _compiled_from_cache(tiny_ir_int8, paged, paged=True)  # ... and not imported

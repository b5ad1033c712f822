"""The continuous-batching core applying LoRA adapters (`core.CoreBatch`, issue 34), on the tiny
checkpoint's IR and PEFT adapters made here: requests for two adapters and the base added at
once each get the library's own greedy tokens for their adapter (the library cannot mix
adapters in a step: the core runs them group by group, `policy.adapter_turns`); an adapter is
read once, told as its load, and read again after `drop_adapter`; a core not built LoRA-able
refuses an adapter rather than answer with the base."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.engine.batch_types import Step
from services.engine.core import CoreBatch, build_pipeline
from shared.adapters import ADAPTER_WEIGHTS
from shared.messages import AdapterRef, SamplingParams
from tests.helpers.adapters import make_adapter

PROMPT = [1, 504, 3575, 282, 4649, 314]
TOKENS = 8
GREEDY = SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory, tiny_checkpoint: Path) -> dict[str, AdapterRef]:
    root = tmp_path_factory.mktemp("core-adapters")
    return {
        name: AdapterRef(
            name=name,
            adapter_id=name,
            path=str(make_adapter(tiny_checkpoint, root / name, seed=seed)),
            scale=2.0,  # lora_alpha 16 over rank 8
            nbytes=0,
            keep_alive_s=60,
        )
        for name, seed in (("a", 1), ("b", 2))
    }


def _library(ir: Path, ref: AdapterRef | None) -> list[int]:
    """The library's own greedy tokens for `ref` (or the base), on a pipeline of its own."""
    import numpy as np
    import openvino as ov
    import openvino_genai as ov_genai

    adapter = ov_genai.Adapter(str(Path(ref.path) / ADAPTER_WEIGHTS)) if ref else None
    scheduler = ov_genai.SchedulerConfig()
    scheduler.enable_prefix_caching = False
    extra = {"adapters": ov_genai.AdapterConfig(adapter)} if adapter else {}
    pipe = ov_genai.ContinuousBatchingPipeline(str(ir), ov_genai.Tokenizer(str(ir)), scheduler, "CPU", **extra)
    config = ov_genai.GenerationConfig(max_new_tokens=TOKENS, do_sample=False, ignore_eos=True)
    config.adapters = ov_genai.AdapterConfig(adapter, ref.scale) if adapter and ref else ov_genai.AdapterConfig()
    [result] = pipe.generate([ov.Tensor(np.asarray([PROMPT], dtype=np.int64))], [config])
    return [int(t) for t in result.m_generation_ids[0]]


def _run(core: CoreBatch) -> tuple[dict[str, list[int]], list[Step]]:
    tokens: dict[str, list[int]] = {}
    loads = []
    while core.active:
        for step in core.steps(0.01):
            assert not step.error, step.error
            tokens.setdefault(step.request_id, []).extend(t for t, _ in step.tokens)
            if step.adapter_load is not None:
                loads.append(step)
    return tokens, loads


def test_two_adapters_and_the_base_at_once_each_get_the_librarys_tokens(
    tiny_ir_int8: Path, adapters: dict[str, AdapterRef]
) -> None:
    refs = {"a": adapters["a"], "b": adapters["b"], "base": None}
    want = {name: _library(tiny_ir_int8, ref) for name, ref in refs.items()}
    assert len({tuple(t) for t in want.values()}) == 3  # each adapter changes the answer

    # Built with `a` alone, as `tiered_batch.kept_adapters` builds for adapters on the same linears:
    # `b` applied on it must still give the library's tokens for `b`.
    files = [str(Path(adapters["a"].path) / ADAPTER_WEIGHTS)]
    core = CoreBatch(build_pipeline(str(tiny_ir_int8), "CPU", 1, files), 0, 49152, 8192, lora=True)
    try:
        for i in range(2):
            for name, ref in refs.items():
                core.add(f"{name}-{i}", PROMPT, GREEDY, adapter=ref)
        tokens, loads = _run(core)
        assert tokens == {f"{name}-{i}": want[name] for name in refs for i in range(2)}
        # Each adapter read once, at its group's first turn, its load told with its first request.
        assert sorted((s.request_id, s.adapter_load.name) for s in loads if s.adapter_load) == [
            ("a-0", "a"),
            ("b-0", "b"),
        ]
        assert core.adapters == ("a", "b")

        core.drop_adapter("a")
        assert core.adapters == ("b",)
        core.add("a-again", PROMPT, GREEDY, adapter=adapters["a"])
        tokens, loads = _run(core)
        assert tokens == {"a-again": want["a"]} and [s.request_id for s in loads] == ["a-again"]
    finally:
        core.close()


def test_a_core_not_built_lora_able_refuses_an_adapter(tiny_ir_int8: Path, adapters: dict[str, AdapterRef]) -> None:
    core = CoreBatch(build_pipeline(str(tiny_ir_int8), "CPU", 1), 0, 49152, 8192)
    try:
        with pytest.raises(ValueError, match="not built LoRA-able"):
            core.add("r", PROMPT, GREEDY, adapter=adapters["a"])
    finally:
        core.close()

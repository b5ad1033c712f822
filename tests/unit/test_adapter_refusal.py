"""A request for a LoRA adapter on a worker whose batch does not apply adapters (a model served
through other nodes' pipeline stages, `PipelineBatch`) is refused with a clear error, never run
as its base."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import pytest

from services.engine.worker_loop import WorkerLoop
from services.engine.worker_wire import Run
from shared.messages import AdapterRef, SamplingParams


class FakeStagesBatch:
    """Stands in for a batch of pipeline stages: it has `add` and no `add_adapted`."""

    def __init__(self) -> None:
        self.added: list[str] = []

    def add(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        deadline: Callable[[int], float],
        kv_tokens: int = 0,
    ) -> None:
        self.added.append(request_id)


def _run(adapter: AdapterRef | None) -> Run:
    return Run("r", "m", (1, 2, 3), SamplingParams(max_tokens=2), 0.05, 0, 0.0, 0.0, 0.0, adapter)


def test_an_adapter_request_on_a_batch_without_adapters_is_refused_not_served_by_its_base() -> None:
    batch = FakeStagesBatch()
    ref = AdapterRef(name="tuned", adapter_id="x", path="/nowhere", scale=2.0, nbytes=1, keep_alive_s=math.inf)
    with pytest.raises(ValueError, match="`tuned` is a LoRA adapter, and this node's engine does not apply"):
        WorkerLoop._add(batch, _run(ref))  # type: ignore[arg-type]
    assert batch.added == []
    WorkerLoop._add(batch, _run(None))  # type: ignore[arg-type]
    assert batch.added == ["r"]

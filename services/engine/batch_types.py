"""What every engine's batch is, whatever its library: the `Batch` protocol the worker loop
drives, the `Step` each request's new tokens travel in, and the helpers every batch shares.
Backend-neutral: no backend module imports another; each imports this."""

from __future__ import annotations

import queue
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from shared.messages import FinishReason, SamplingParams, TokenLogprob


def check_fits(prompt_tokens: int, max_tokens: int, kv_tokens: int) -> None:
    """Refuse (ValueError, that request alone) a request longer than the batch's KV cache: in
    the batch it would stop every request (the library has nothing to evict to make room)."""
    if prompt_tokens + max_tokens > kv_tokens:
        raise ValueError(
            f"the prompt ({prompt_tokens} tokens) and max_tokens ({max_tokens}) exceed this "
            f"worker's KV cache of {kv_tokens} tokens (TESSERA_TORCH_KV_TOKENS)"
        )


def ends_of_sequence(tokenizer: Any, config_eos: int | list[int] | None) -> frozenset[int]:
    """The tokens that end a completion: the tokenizer's and the model config's ends of
    sequence, and ChatML's end of turn where the vocabulary has it."""
    ids = {tokenizer.eos_token_id, *(_as_list(config_eos))}
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    if isinstance(end, int) and end != tokenizer.unk_token_id:
        ids.add(end)
    return frozenset(i for i in ids if i is not None)


def _as_list(x: int | list[int] | None) -> list[int]:
    if x is None:
        return []
    return [x] if isinstance(x, int) else list(x)


@dataclass(frozen=True)
class Step:
    """What one request got since the last look: its new tokens, and how it ended if it did."""

    request_id: str
    tokens: tuple[tuple[int, TokenLogprob | None], ...]
    finish: FinishReason | None = None
    error: str = ""
    prefill_tokens: int = 0
    """Positions its prefill computed, where the batch knows better than its prompt's length
    (a static batch pads every row to the longest); 0: its prompt's."""


def merged(before: Step, after: Step) -> Step:
    """Two steps of one request, in order, as one."""
    return Step(
        after.request_id,
        before.tokens + after.tokens,
        after.finish,
        after.error,
        max(before.prefill_tokens, after.prefill_tokens),
    )


def drain(steps: queue.Queue[Step], timeout: float, wanted: Callable[[str], bool] = lambda _: True) -> dict[str, Step]:
    """The steps waiting in `steps` (waiting up to `timeout` for the first), by request, those
    of one request merged in order into one; a request not `wanted` (cancelled) is skipped."""
    out: dict[str, Step] = {}
    wait: float | None = timeout
    while True:
        try:
            step = steps.get(timeout=wait) if wait else steps.get_nowait()
        except queue.Empty:
            return out
        wait = None
        if not wanted(step.request_id):
            continue
        before = out.get(step.request_id)
        if before is not None:
            step = merged(before, step)
        out[step.request_id] = step


class Batch(Protocol):
    """What the worker's loop (`worker_loop.py`) drives: `ContinuousBatcher`, `VllmBatch`,
    `PipelineBatch` (fakes in the unit tests). It makes tokens only: text, stop strings,
    chunking and every figure of a request's `Done` are the loop's. `steps` reports each
    request's end once (`finish`, or `error`: that request alone failed); `cancel` of a request
    it no longer holds does nothing."""

    @property
    def active(self) -> int: ...

    @property
    def waited(self) -> float: ...

    @property
    def alive(self) -> bool: ...

    def set_threads(self, threads: int) -> None: ...

    @property
    def kv_bytes(self) -> int:
        """Its KV cache, allocated in this process (0 where another process holds it)."""
        ...

    def device_bytes(self) -> int:
        """What this process holds on a GPU outside the node's arena (0 on the host)."""
        ...

    def add(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        deadline: Callable[[int], float],
        kv_tokens: int = 0,
    ) -> None:
        """`deadline(generated)`: when its next token is due; `kv_tokens`: the positions the
        engine's KV reservation for it covers (`Run.kv_tokens`; 0: the batch's own bound)."""
        ...

    def cancel(self, request_id: str) -> None: ...

    def steps(self, timeout: float) -> list[Step]: ...

    def close(self) -> None: ...

"""What every engine's batch is: the `Batch` the worker loop drives, the `Step` its tokens
travel in, and shared helpers. Backend-neutral: each backend imports this, none another."""

from __future__ import annotations

import dataclasses
import queue
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from shared.messages import AdapterRef, FinishReason, SamplingParams, TokenLogprob


def check_fits(prompt_tokens: int, max_tokens: int, kv_tokens: int) -> None:
    """Refuse (that request alone) one longer than the KV cache: in the batch it would stop
    every request (the library has nothing to evict)."""
    if prompt_tokens + max_tokens > kv_tokens:
        raise ValueError(
            f"the prompt ({prompt_tokens} tokens) and max_tokens ({max_tokens}) exceed this "
            f"worker's KV cache of {kv_tokens} tokens (TESSERA_TORCH_KV_TOKENS)"
        )


def ends_of_sequence(tokenizer: Any, config_eos: int | list[int] | None) -> frozenset[int]:
    """The tokenizer's and the model config's ends of sequence, and ChatML's end of turn."""
    ids = {tokenizer.eos_token_id, *([config_eos] if isinstance(config_eos, int) else config_eos or [])}
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    if isinstance(end, int) and end != tokenizer.unk_token_id:
        ids.add(end)
    return frozenset(i for i in ids if i is not None)


@dataclass(frozen=True)
class Step:
    """What one request got since the last look: its new tokens, and how it ended if it did."""

    request_id: str
    tokens: tuple[tuple[int, TokenLogprob | None], ...]
    finish: FinishReason | None = None
    error: str = ""
    prefill_tokens: int = 0
    """Positions its prefill computed where not its prompt's (a static batch pads); 0: its prompt's."""
    adapter_load: AdapterLoad | None = None
    """Its adapter was loaded for it just now (told once, with no tokens)."""


@dataclass(frozen=True)
class AdapterLoad:
    """An adapter's start on a warm base (issue 34): reading its file, and applying it."""

    name: str
    load_s: float
    apply_s: float


def drain(steps: queue.Queue[Step], timeout: float, wanted: Callable[[str], bool] = lambda _: True) -> dict[str, Step]:
    """The steps waiting (up to `timeout` for the first), one per request, merged in order; a
    request not `wanted` (cancelled) is skipped."""
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
            tokens, prefill = before.tokens + step.tokens, max(before.prefill_tokens, step.prefill_tokens)
            step = dataclasses.replace(step, tokens=tokens, prefill_tokens=prefill)
        out[step.request_id] = step


class Batch(Protocol):
    """It makes tokens only: text, stop strings, chunking and `Done`'s figures are the loop's.
    `steps` reports each request's end once (`finish`, or `error`: it alone failed); `cancel`
    of a request it no longer holds does nothing. Batches implement it structurally (no
    engine class subclasses it)."""

    @property
    def active(self) -> int: ...

    @property
    def waited(self) -> float: ...

    @property
    def alive(self) -> bool:
        return True

    def set_threads(self, threads: int) -> None:
        return None

    @property
    def kv_bytes(self) -> int:
        """Its KV cache, allocated in this process."""
        return 0

    def device_bytes(self) -> int:
        """What this process holds on a GPU outside the node's arena."""
        return 0

    def add(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        deadline: Callable[[int], float],
        kv_tokens: int = 0,
    ) -> None:
        """`deadline(generated)`: when its next token is due; `kv_tokens`: `Run.kv_tokens`."""
        ...

    def cancel(self, request_id: str) -> None: ...

    def steps(self, timeout: float) -> list[Step]: ...

    def close(self) -> None: ...


class AdaptedBatch(Batch, Protocol):
    """A batch that applies LoRA adapters (issue 34): `add_adapted` is `add` with the request's
    adapter (loaded at its first use, kept until `drop_adapter`). A batch without these
    refuses a request for an adapter (never serves it the base's output)."""

    add_adapted: Callable[[str, Sequence[int], SamplingParams, Callable[[int], float], int, AdapterRef], None]
    """(request_id, prompt_ids, params, deadline, kv_tokens, adapter)."""

    def drop_adapter(self, name: str) -> None: ...

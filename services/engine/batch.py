"""Several sequences in one forward pass of a stateful OpenVINO LLM.

On CPU a decode step of a small model is bound by reading its weights, not by arithmetic:
B sequences decoded together cost little more than one (Orca, vLLM: batching is where a
serving engine's throughput comes from). A burst of first requests to a model that just
started (issue 5's 16) or a burst to a warm one (the `chat` bursts of bench/cluster.py)
would otherwise queue one behind the other, each waiting for the whole generation of every
request ahead.

The stateful IR keeps one KV cache per row of the batch in its infer request, all rows at the
same position. So a batch is formed when the worker is free (whatever is queued, up to
`max_batch` and the KV budget), its prompts left-padded to the longest (padding masked out by
`attention_mask`, positions counted per row), and decoded together; a row that finishes
leaves the batch at once (`beam_idx` gathers the remaining rows of the cache, as beam search
does), so it costs nothing further. A request that arrives meanwhile joins the running batch
when re-prefilling it is cheap (`joinable`, `generate_batch`), else it waits for the next one.
A batch of one feeds exactly the inputs a single sequence always did.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import openvino as ov

from services.engine.sampling import Sampler, token_logprob
from services.engine.stops import StopMatcher
from shared.messages import FinishReason, SamplingParams, TokenLogprob

PAD_ID = 0
"""Fills the left of shorter prompts; masked out, so any id serves."""


@dataclass(frozen=True)
class BatchItem:
    """One request of a batch."""

    request_id: str
    prompt_ids: Sequence[int]
    params: SamplingParams


@dataclass
class RowResult:
    request_id: str
    finish_reason: FinishReason
    completion_tokens: int
    first_token_at: float | None
    """time.monotonic() of its first text (CLOCK_MONOTONIC: comparable across processes)."""


RowEmit = Callable[[str, str, int, tuple[TokenLogprob, ...]], None]
"""emit(request_id, text, tokens, logprobs): logprobs holds one entry per token when the
request asked for them, else ()."""


class TextSink(Protocol):
    """Where a row's tokens go: detokenized, through its stop strings, out (instance.py)."""

    def write(self, tokens: Sequence[int]) -> None: ...

    def end(self) -> None:
        """Everything still held goes out."""


TextFactory = Callable[[Callable[[str, str, int], None], str, StopMatcher], TextSink]
"""text(emit(request_id, text, tokens), request_id, stops): the row's sink."""


def batch_tokens(prompts: Sequence[int], max_tokens: Sequence[int]) -> int:
    """KV cache positions a batch may fill: every row is as long as the longest prompt plus
    the longest completion (rows are padded to a common position)."""
    return len(prompts) * (max(prompts) + max(max_tokens))


def take_batch(queue: Sequence[tuple[int, int]], max_batch: int, kv_tokens: int) -> int:
    """How many of the queued requests, each (prompt tokens, max_tokens), in order, to run as
    one batch: as many as `max_batch` and the KV budget allow, and always the first."""
    return 1 + joinable(queue[:1], queue[1:], max_batch, kv_tokens, recompute_tokens=sys.maxsize)


def joinable(
    running: Sequence[tuple[int, int]],
    queue: Sequence[tuple[int, int]],
    max_batch: int,
    kv_tokens: int,
    recompute_tokens: int,
) -> int:
    """How many queued requests, each (prompt tokens, max_tokens), join the running batch
    whose rows are each (context tokens, tokens left): within `max_batch` and the KV budget,
    and only while re-prefilling the running rows costs at most `recompute_tokens` positions
    (else they wait for the next batch)."""
    if not running or not queue or sum(c for c, _ in running) > recompute_tokens:
        return 0
    n = 0
    while len(running) + n < max_batch and n < len(queue):
        rows = [*running, *queue[: n + 1]]
        if batch_tokens([c for c, _ in rows], [m for _, m in rows]) > kv_tokens:
            break
        n += 1
    return n


class _Row:
    """One sequence's decoding state: sampling, stop strings, text out, why it ended."""

    def __init__(
        self, seq: BatchItem, eos_ids: frozenset[int], text: TextFactory, emit: RowEmit, interval_s: float
    ) -> None:
        self.seq = seq
        p = seq.params
        self.sampler = Sampler.of(p)
        self.stops = StopMatcher(p.stop)
        self.eos_ids = eos_ids
        self.first: float | None = None
        self.logprobs: list[TokenLogprob] = []
        """Logprobs of the tokens not yet sent (each piece takes those of its tokens)."""

        def timed(request_id: str, piece: str, tokens: int) -> None:
            if self.first is None:
                self.first = time.monotonic()
            taken = tuple(self.logprobs[:tokens])
            del self.logprobs[:tokens]
            emit(request_id, piece, tokens, taken)

        self.text = text(timed, seq.request_id, self.stops)
        # Detokenizing costs two detokenizer runs; without stop strings to watch, it is done
        # once per stream interval for the tokens since, not once per token (measured ≈ 8 %
        # of decode time per token otherwise). With stop strings, every token is checked at
        # once so that generation ends exactly at the stop.
        self.hold_s = 0.0 if p.stop else interval_s
        self.held: list[int] = []
        self.last_text: float | None = None
        self.produced = 0
        self.reason = FinishReason.LENGTH
        self.context: list[int] = list(seq.prompt_ids)
        """Its prompt and every token it has generated (what a re-prefill feeds)."""

    @property
    def left(self) -> int:
        """Tokens it may still generate."""
        return self.seq.params.max_tokens - self.produced

    def step(self, logits: np.ndarray, cancelled: bool) -> int | None:
        """The row's next token from its logits, or None once it has ended."""
        p = self.seq.params
        token = self.sampler.pick(logits, self.context)
        if token in self.eos_ids and not p.ignore_eos:
            self.reason = FinishReason.STOP
            return None
        if p.logprobs >= 0:
            adjusted = self.sampler.adjusted
            self.logprobs.append(token_logprob(logits if adjusted is None else adjusted, token, p.logprobs))
        self.produced += 1
        self.held.append(token)
        self.context.append(token)
        now = time.perf_counter()
        if self.last_text is None or now - self.last_text >= self.hold_s:
            self.text.write(self.held)
            self.held.clear()
            self.last_text = now
        if self.stops.stopped:
            self.reason = FinishReason.STOP
            return None
        if cancelled:
            self.reason = FinishReason.CANCELLED
            return None
        if self.produced >= p.max_tokens:
            return None
        return token

    def end(self) -> RowResult:
        self.text.write(self.held)
        self.held.clear()
        self.text.end()
        return RowResult(self.seq.request_id, self.reason, self.produced, self.first)


Join = Callable[[Sequence[tuple[int, int]]], Sequence[BatchItem]]
"""join(rows): requests to add to the running batch now, given each running row's (context
tokens so far, tokens it may still generate); none to keep the batch as it is."""


def _prefill(request: ov.InferRequest, contexts: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Reset the cache and prefill `contexts` left-padded to the longest: the rows' logits at
    their last position, and the attention mask the decode steps extend."""
    lengths = [len(c) for c in contexts]
    width = max(lengths)
    b = len(contexts)
    ids = np.full((b, width), PAD_ID, dtype=np.int64)
    mask = np.zeros((b, width), dtype=np.int64)
    positions = np.zeros((b, width), dtype=np.int64)
    for i, c in enumerate(contexts):
        n = lengths[i]
        ids[i, width - n :] = c
        mask[i, width - n :] = 1
        positions[i, width - n :] = np.arange(n)
    request.reset_state()
    request.infer(
        {"input_ids": ids, "attention_mask": mask, "position_ids": positions, "beam_idx": np.arange(b, dtype=np.int32)}
    )
    return request.get_tensor("logits").data[:, -1], mask


def generate_batch(
    request_for: Callable[[int], ov.InferRequest],
    seqs: Sequence[BatchItem],
    eos_ids: frozenset[int],
    text: TextFactory,
    emit: RowEmit,
    is_cancelled: Callable[[str], bool],
    interval_s: float = 0.0,
    between_steps: Callable[[], None] | None = None,
    join: Join | None = None,
) -> list[RowResult]:
    """Generate every sequence of `seqs` together, on `request_for(rows)` (an infer request
    fit for that many rows; its state is reset first). `between_steps` runs once per decode
    step (the worker reads cancels and new requests); `join` may then add requests.

    A request that joins a running batch cannot take a row of the cache as it is (every row is
    at the same position): the batch is prefilled again, each running row with its prompt and
    the tokens it has generated so far, the newcomers with their prompts (vLLM's recomputation,
    used here to join instead of to preempt). Rows keep their sampling and text state, so a
    running request's stream goes on as if nothing happened; `join` bounds what that costs."""
    rows = [_Row(s, eos_ids, text, emit, interval_s) for s in seqs]
    request = request_for(len(rows))
    logits, mask = _prefill(request, [s.prompt_ids for s in seqs])
    active = list(range(len(rows)))  # rows of `rows` in the order of the cache's rows
    next_pos = np.asarray([len(s.prompt_ids) for s in seqs], dtype=np.int64)
    results: dict[int, RowResult] = {}
    while active:
        if between_steps is not None:
            between_steps()
        keep: list[int] = []
        tokens: list[int] = []
        for k, i in enumerate(active):
            row = rows[i]
            token = row.step(logits[k], is_cancelled(row.seq.request_id))
            if token is None:
                results[i] = row.end()
            else:
                keep.append(k)
                tokens.append(token)
        active = [active[k] for k in keep]
        joining = join([(len(rows[i].context), rows[i].left) for i in active]) if join is not None else ()
        if joining:
            first = len(rows)
            rows += [_Row(s, eos_ids, text, emit, interval_s) for s in joining]
            active += list(range(first, len(rows)))
            request = request_for(len(active))
            logits, mask = _prefill(request, [rows[i].context for i in active])
            next_pos = np.asarray([len(r.context) for r in rows], dtype=np.int64)
            continue
        if not keep:
            break
        idx = np.asarray(keep)
        mask = np.concatenate([mask[idx], np.ones((len(keep), 1), dtype=np.int64)], axis=1)
        pos = next_pos[active][:, None]
        request.infer(
            {
                "input_ids": np.asarray(tokens, dtype=np.int64)[:, None],
                "attention_mask": mask,
                "position_ids": pos,
                "beam_idx": idx.astype(np.int32),
            }
        )
        next_pos[active] += 1
        logits = request.get_tensor("logits").data[:, -1]
    return [results[i] for i in range(len(rows))]

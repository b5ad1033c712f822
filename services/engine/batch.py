"""The start tier: several sequences in one forward pass of a stateful OpenVINO LLM, as a `Batch`.

It serves a start's first requests on the materialized stateful IR, whose compiled blob a start
imports (the core must be compiled, ≈ 2.4 s: `tiered_batch.py` builds it meanwhile), and always
the requests that need the logits (`core.needs_logits`), with its own `sampling.Sampler`. On
CPU a small model's decode step is bound by reading its weights: B sequences together cost
little more than one (Orca, vLLM), so a burst of first requests need not queue.

The IR keeps one KV cache row per sequence, all at one position. A batch is formed when the
last is over (up to `max_batch` and the KV budget), prompts left-padded to the longest (masked
out, positions counted per row); a row that ends leaves at the next pass (`beam_idx` gathers
the remaining rows, as beam search does). A request that arrives meanwhile joins when
re-prefilling the running rows is cheap (`joinable`), else waits for the next batch. Each
`steps` call is one forward pass (a prefill, a re-prefill that joins, or a decode step).
"""

from __future__ import annotations

import math
import sys
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import msgspec
import numpy as np
import openvino as ov

from services.engine.batch_types import Step
from services.engine.core import check_prompt
from services.engine.sampling import Sampler, token_logprob
from services.engine.step_gate import TakeTurn, Turns, most_urgent, no_turn, post
from shared.messages import FinishReason, SamplingParams, TokenLogprob

PAD_ID = 0
"""Fills the left of shorter prompts; masked out, so any id serves."""


def batch_tokens(prompts: Sequence[int], max_tokens: Sequence[int]) -> int:
    """KV positions a batch may fill: every row padded to the longest prompt and completion."""
    return len(prompts) * (max(prompts) + max(max_tokens))


def take_batch(queue: Sequence[tuple[int, int]], max_batch: int, kv_tokens: int) -> int:
    """How many queued (prompt tokens, max_tokens), in order, form the next batch (at least one)."""
    return 1 + joinable(queue[:1], queue[1:], max_batch, kv_tokens, recompute_tokens=sys.maxsize)


def joinable(
    running: Sequence[tuple[int, int]],
    queue: Sequence[tuple[int, int]],
    max_batch: int,
    kv_tokens: int,
    recompute_tokens: int,
) -> int:
    """How many queued (prompt tokens, max_tokens) join the running rows (context tokens,
    tokens left): within `max_batch` and the KV budget, and only while re-prefilling the
    running rows costs at most `recompute_tokens` positions."""
    if not running or not queue or sum(c for c, _ in running) > recompute_tokens:
        return 0
    n = 0
    while len(running) + n < max_batch and n < len(queue):
        rows = [*running, *queue[: n + 1]]
        if batch_tokens([c for c, _ in rows], [m for _, m in rows]) > kv_tokens:
            break
        n += 1
    return n


@dataclass(frozen=True)
class Request:
    request_id: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    deadline: Callable[[int], float]
    kv_tokens: int = 0
    """`worker_wire.Run.kv_tokens`."""


class _Row:
    def __init__(self, request: Request, positions: int) -> None:
        self.request = request
        self.sampler = Sampler.of(request.params)
        self.context: list[int] = list(request.prompt_ids)
        """Its prompt and every token generated (what a re-prefill feeds)."""
        self.produced = 0
        self.positions = positions
        """Positions the prefill it joined in computed."""
        self.ended = False
        """It leaves the cache at the next forward pass."""

    @property
    def left(self) -> int:
        return self.request.params.max_tokens - self.produced

    def rest(self) -> Request:
        """What is left of it, for another batch to go on from its next token."""
        r, done = self.request, self.produced
        params = msgspec.structs.replace(r.params, max_tokens=self.left)
        return Request(
            r.request_id, tuple(self.context), params, lambda generated: r.deadline(done + generated), r.kv_tokens
        )

    def pick(self, logits: np.ndarray, eos_ids: frozenset[int]) -> Step:
        """Its next token, as a step (its last where it ends)."""
        p = self.request.params
        token = self.sampler.pick(logits, self.context)
        tokens: tuple[tuple[int, TokenLogprob | None], ...] = ()
        if token in eos_ids and not p.ignore_eos:
            finish: FinishReason | None = FinishReason.STOP
        else:
            assert self.sampler.adjusted is not None  # (its logprobs are read after penalties and bias)
            logprob = token_logprob(self.sampler.adjusted, token, p.logprobs) if p.logprobs >= 0 else None
            tokens = ((token, logprob),)
            self.produced += 1
            self.context.append(token)
            finish = FinishReason.LENGTH if self.produced >= p.max_tokens else None
        self.ended = finish is not None
        return Step(self.request.request_id, tokens, finish, prefill_tokens=self.positions)

    def deadline(self) -> float:
        return self.request.deadline(self.produced)


def vocab_size(compiled: ov.CompiledModel) -> int:
    return int(compiled.output("logits").get_partial_shape()[-1].get_length())


class StartBatch:
    """The stateful tier as a `Batch`. `compiled`: the model (its infer request's state is the
    running batch's KV cache); `kv_tokens`: the positions a batch may hold (one context, or a
    request's grown reservation); `join_recompute_tokens`: see `joinable`. A failed pass fails
    its batch's requests alone: the next batch gets a new infer request (it stays alive). Its
    state is no KV cache the node's book counts."""

    def __init__(
        self,
        compiled: ov.CompiledModel,
        eos_ids: frozenset[int],
        kv_tokens: int,
        turn: TakeTurn = no_turn,
        max_batch: int = 1,
        join_recompute_tokens: int = 0,
    ) -> None:
        self._turns = Turns(turn)
        self.compiled = compiled
        self.eos_ids = eos_ids
        self.kv_tokens = kv_tokens
        self.vocab_size = vocab_size(compiled)
        self.max_batch = max(1, max_batch)
        self.join_recompute_tokens = join_recompute_tokens
        self.queue: deque[Request] = deque()
        self._rows: list[_Row] = []
        """The running batch's rows, in the order of the cache's rows (the last pass's)."""
        self._mask = np.zeros((0, 0), dtype=np.int64)
        self._request: ov.InferRequest | None = None
        self._request_rows = 0
        self._arriving = 0
        """Queue length seen at the last decode step (joins wait while it grows)."""

    @property
    def active(self) -> int:
        return len(self.queue) + len(self._going())

    @property
    def running(self) -> bool:
        return bool(self._going())

    @property
    def waited(self) -> float:
        return self._turns.waited

    @property
    def alive(self) -> bool:
        return True

    def set_threads(self, threads: int) -> None:
        """Its threads are fixed when it is compiled."""

    @property
    def kv_bytes(self) -> int:
        return 0

    def device_bytes(self) -> int:
        return 0  # nothing on a GPU

    def add(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        deadline: Callable[[int], float] = lambda _: math.inf,
        kv_tokens: int = 0,
    ) -> None:
        check_prompt(prompt_ids, params.max_tokens, self.vocab_size, max(self.kv_tokens, kv_tokens))
        self.queue.append(Request(request_id, tuple(prompt_ids), params, deadline, kv_tokens))

    def cancel(self, request_id: str) -> None:
        """Queued, it goes at once; running, its row leaves before the next pass."""
        self.queue = deque(r for r in self.queue if r.request_id != request_id)
        for row in self._rows:
            if row.request.request_id == request_id:
                row.ended = True

    def hand_over(self, keep: Callable[[SamplingParams], bool]) -> list[Request]:
        """Every request but those `keep` says stay, as what is left of it (`_Row.rest`), for
        another batch (the core, once built) to go on from; no step of them follows here."""
        moved = [r for r in self.queue if not keep(r.params)]
        self.queue = deque(r for r in self.queue if keep(r.params))
        for row in self._going():
            if not keep(row.request.params):
                moved.append(row.rest())
                row.ended = True
        return moved

    def steps(self, timeout: float) -> list[Step]:
        """One forward pass (`timeout` is not waited: with requests there is always one to run)."""
        going = self._going()
        joining: list[Request] = []
        if going:
            joining = self._join(going)
        elif self.queue:
            budget = self._kv_budget()
            n = take_batch([(len(r.prompt_ids), r.params.max_tokens) for r in self.queue], self.max_batch, budget)
            joining = [self.queue.popleft() for _ in range(n)]
        else:
            self._rows = []
            return []
        deadline = most_urgent([*(row.deadline() for row in going), *(r.deadline(0) for r in joining)])
        try:
            with self._turns(deadline) as held:
                logits = self._prefill(going, joining) if joining else self._decode(going)
                out = [row.pick(logits[k], self.eos_ids) for k, row in enumerate(self._rows)]
                post(held, [*(row.deadline() for row in self._going()), *(r.deadline(0) for r in self.queue)])
        except Exception as e:  # every request of the batch fails; the next batch starts anew
            message = f"{type(e).__name__}: {e}"
            self._rows, self._request = [], None
            return [Step(r.request_id, (), None, message) for r in [*(row.request for row in going), *joining]]
        return out

    def close(self) -> None:
        self.queue.clear()
        self._rows, self._request = [], None

    def release(self) -> bool:
        """Let the idle infer request (the memory its state holds) go; True if that freed it."""
        if self._request is None or self.running:
            return False
        self._request, self._request_rows, self._rows = None, 0, []
        return True

    def _going(self) -> list[_Row]:
        return [row for row in self._rows if not row.ended]

    def _kv_budget(self) -> int:
        return max([self.kv_tokens, *(r.kv_tokens for r in self.queue)])

    def _join(self, going: list[_Row]) -> list[Request]:
        if not self.queue:
            self._arriving = 0
            return []
        if len(self.queue) > self._arriving:
            # A burst reaches the worker over a few steps: wait, to join in one re-prefill.
            self._arriving = len(self.queue)
            return []
        self._arriving = 0
        n = joinable(
            [(len(row.context), row.left) for row in going],
            [(len(r.prompt_ids), r.params.max_tokens) for r in self.queue],
            self.max_batch,
            self._kv_budget(),
            self.join_recompute_tokens,
        )
        return [self.queue.popleft() for _ in range(n)]

    def _request_for(self, rows: int) -> ov.InferRequest:
        if self._request is None or rows > self._request_rows:
            # After `reset_state`, OpenVINO 2026.4's CPU plugin kept rows beyond the old width
            # wrong once the cache grew (their text diverged after ≈ 7 tokens): a new request.
            self._request = self.compiled.create_infer_request()
            self._request_rows = rows
        return self._request

    def _prefill(self, going: list[_Row], joining: list[Request]) -> np.ndarray:
        """A new batch, or the running one with `joining` added: every row is at one position,
        so the batch is prefilled again, left-padded, running rows with their context so far
        (vLLM's recomputation, used to join rather than to preempt)."""
        b = len(going) + len(joining)
        width = max([len(row.context) for row in going] + [len(r.prompt_ids) for r in joining])
        self._rows = [*going, *(_Row(r, b * width) for r in joining)]
        ids = np.full((b, width), PAD_ID, dtype=np.int64)
        self._mask = np.zeros((b, width), dtype=np.int64)
        positions = np.zeros((b, width), dtype=np.int64)
        for i, c in enumerate(row.context for row in self._rows):
            ids[i, width - len(c) :] = c
            self._mask[i, width - len(c) :] = 1
            positions[i, width - len(c) :] = np.arange(len(c))
        request = self._request_for(b)
        request.reset_state()
        beam_idx = np.arange(b, dtype=np.int32)
        request.infer({"input_ids": ids, "attention_mask": self._mask, "position_ids": positions, "beam_idx": beam_idx})
        return request.get_tensor("logits").data[:, -1]

    def _decode(self, going: list[_Row]) -> np.ndarray:
        """One decode step of the rows still going, gathered from the last pass's cache rows."""
        keep = np.asarray([k for k, row in enumerate(self._rows) if not row.ended])
        self._mask = np.concatenate([self._mask[keep], np.ones((len(keep), 1), dtype=np.int64)], axis=1)
        self._rows = going
        request = self._request_for(len(going))
        request.infer(
            {
                "input_ids": np.asarray([[row.context[-1]] for row in going], dtype=np.int64),
                "attention_mask": self._mask,
                "position_ids": np.asarray([[len(row.context) - 1] for row in going], dtype=np.int64),
                "beam_idx": keep.astype(np.int32),
            }
        )
        return request.get_tensor("logits").data[:, -1]

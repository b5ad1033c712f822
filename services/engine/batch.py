"""The start tier: several sequences in one forward pass of a stateful OpenVINO LLM, as one of
the worker's `Batch`es (`batch_types.py`).

It serves a start's first requests on the materialized stateful IR, whose compiled blob a start
imports (the continuous-batching core must be compiled, ≈ 2.4 s: `tiered_batch.py` builds it
meanwhile), and always the requests that need the logits (`core.needs_logits`), with its own
sampler (`sampling.Sampler`: seeds, penalties, logit_bias, top_logprobs).

On CPU a decode step of a small model is bound by reading its weights, not by arithmetic:
B sequences decoded together cost little more than one (Orca, vLLM: batching is where a
serving engine's throughput comes from). A burst of first requests to a model that just
started (issue 5's 16) would otherwise queue one behind the other, each waiting for the whole
generation of every request ahead.

The stateful IR keeps one KV cache per row of the batch in its infer request, all rows at the
same position. So a batch is formed when the last one is over (whatever is queued, up to
`max_batch` and the KV budget), its prompts left-padded to the longest (padding masked out by
`attention_mask`, positions counted per row), and decoded together; a row that finishes or is
cancelled leaves the batch at the next pass (`beam_idx` gathers the remaining rows of the
cache, as beam search does), so it costs nothing further. A request that arrives meanwhile
joins the running batch when re-prefilling it is cheap (`joinable`), else it waits for the
next one. A batch of one feeds exactly the inputs a single sequence always did.

Each `steps` call runs one forward pass (a prefill, a re-prefill that joins, or one decode
step) and samples every row's next token from it: the tokens go out as soon as they exist.
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


@dataclass(frozen=True)
class Request:
    """A request added to the batch (and what it hands over to another batch: `hand_over`)."""

    request_id: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    deadline: Callable[[int], float]
    kv_tokens: int = 0
    """Tokens its name's KV reservation covered (`worker_wire.Run.kv_tokens`)."""


class _Row:
    """One request's decoding state: its sampler, its context, what it produced."""

    def __init__(self, request: Request, positions: int) -> None:
        self.request = request
        self.sampler = Sampler.of(request.params)
        self.context: list[int] = list(request.prompt_ids)
        """Its prompt and every token it has generated (what a re-prefill feeds)."""
        self.produced = 0
        self.positions = positions
        """Positions the prefill it joined in computed."""
        self.ended = False
        """Finished or cancelled: it leaves the cache at the next forward pass."""

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def left(self) -> int:
        """Tokens it may still generate."""
        return self.request.params.max_tokens - self.produced

    def rest(self) -> Request:
        """What is left of it: its context so far as the prompt, the tokens it may still make
        as max_tokens, and its deadline counted on from the tokens it made."""
        r, done = self.request, self.produced

        def deadline(generated: int) -> float:
            return r.deadline(done + generated)

        params = msgspec.structs.replace(r.params, max_tokens=self.left)
        return Request(r.request_id, tuple(self.context), params, deadline, r.kv_tokens)

    def pick(self, logits: np.ndarray, eos_ids: frozenset[int]) -> Step:
        """Its next token from its logits, as a step (its last where it ends)."""
        p = self.request.params
        token = self.sampler.pick(logits, self.context)
        if token in eos_ids and not p.ignore_eos:
            return self._end((), FinishReason.STOP)
        logprob: TokenLogprob | None = None
        if p.logprobs >= 0:
            adjusted = self.sampler.adjusted
            logprob = token_logprob(logits if adjusted is None else adjusted, token, p.logprobs)
        self.produced += 1
        self.context.append(token)
        if self.produced >= p.max_tokens:
            return self._end(((token, logprob),), FinishReason.LENGTH)
        return Step(self.request_id, ((token, logprob),), prefill_tokens=self.positions)

    def _end(self, tokens: tuple[tuple[int, TokenLogprob | None], ...], finish: FinishReason) -> Step:
        self.ended = True
        return Step(self.request_id, tokens, finish, prefill_tokens=self.positions)

    def deadline(self) -> float:
        """Its next token's."""
        return self.request.deadline(self.produced)


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


def vocab_size(compiled: ov.CompiledModel) -> int:
    return int(compiled.output("logits").get_partial_shape()[-1].get_length())


class StartBatch:
    """The stateful tier as a `Batch`. `compiled`: the model (its infer request, whose state is
    the running batch's KV cache, is made on the first batch and kept); `kv_tokens`: the KV
    positions a batch may hold (one context), or more for requests whose name's reservation
    grew (`Request.kv_tokens`); `join_recompute_tokens`: the most positions of running rows a
    join may re-prefill (`joinable`); `idle`: called when the batch has nothing left to run but
    not from a pass (a cancel, a close), to take its posting at the gate down."""

    def __init__(
        self,
        compiled: ov.CompiledModel,
        eos_ids: frozenset[int],
        kv_tokens: int,
        turn: TakeTurn = no_turn,
        max_batch: int = 1,
        join_recompute_tokens: int = 0,
        idle: Callable[[], None] = lambda: None,
    ) -> None:
        self.compiled = compiled
        self.eos_ids = eos_ids
        self.kv_tokens = kv_tokens
        self.vocab_size = vocab_size(compiled)
        self.max_batch = max(1, max_batch)
        self.join_recompute_tokens = join_recompute_tokens
        self._turns = Turns(turn)
        self._idle = idle
        self.queue: deque[Request] = deque()
        self._rows: list[_Row] = []
        """The running batch's rows, in the order of the cache's rows (the last pass's)."""
        self._logits: np.ndarray | None = None
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
        """A batch is running (rows are in the cache, to be decoded further)."""
        return bool(self._going())

    @property
    def waited(self) -> float:
        return self._turns.waited

    @property
    def alive(self) -> bool:
        return True  # a failed pass fails its batch's requests; the next batch gets a new infer request

    def set_threads(self, threads: int) -> None:
        """The compiled model's threads are fixed when it is compiled."""

    kv_bytes = 0  # the stateful IR's cache is the infer request's state, no allocation the node trues up

    def device_bytes(self) -> int:
        return 0

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
        """Queued, it goes at once; running, its row leaves before the next pass (after the
        token it has). Either way no step of it follows."""
        for request in self.queue:
            if request.request_id == request_id:
                self.queue.remove(request)
                break
        for row in self._rows:
            if row.request_id == request_id:
                row.ended = True
        if not self.active:
            self._idle()

    def hand_over(self, keep: Callable[[SamplingParams], bool]) -> list[Request]:
        """Take every request out of the batch but those `keep` says stay, each as what is
        left of it (`_Row.rest`), for another batch to go on from its next token (the core,
        once built: `tiered_batch.py`). No step of them follows here."""
        moved = [r for r in self.queue if not keep(r.params)]
        self.queue = deque(r for r in self.queue if keep(r.params))
        for row in self._going():
            if not keep(row.request.params):
                moved.append(row.rest())
                row.ended = True
        return moved

    def steps(self, timeout: float) -> list[Step]:
        """One forward pass and the token it gave each row (`timeout` is not waited: with
        requests there is always a pass to run, and without none)."""
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
                if joining:
                    self._prefill(going, joining)
                else:
                    self._decode(going)
                assert self._logits is not None
                out = [row.pick(self._logits[k], self.eos_ids) for k, row in enumerate(self._rows)]
                post(held, [*(row.deadline() for row in self._going()), *(r.deadline(0) for r in self.queue)])
        except Exception as e:  # every request of the batch fails; the next batch starts anew
            message = f"{type(e).__name__}: {e}"
            self._rows, self._request = [], None
            return [Step(r.request_id, (), None, message) for r in [*(row.request for row in going), *joining]]
        return out

    def close(self) -> None:
        self.queue.clear()
        self._rows = []
        self._request = None
        self._idle()

    def release(self) -> bool:
        """Let the infer request (and the memory its state holds) go, when no batch runs;
        True if that freed it."""
        if self._request is None or self.running:
            return False
        self._request, self._request_rows, self._rows = None, 0, []
        return True

    def _going(self) -> list[_Row]:
        return [row for row in self._rows if not row.ended]

    def _kv_budget(self) -> int:
        return max([self.kv_tokens, *(r.kv_tokens for r in self.queue)])

    def _join(self, going: list[_Row]) -> list[Request]:
        """Queued requests that join the running batch now (`joinable`)."""
        if not self.queue:
            self._arriving = 0
            return []
        if len(self.queue) > self._arriving:
            # Still arriving (a burst reaches the worker over a few steps): wait a step, so
            # that they join in one re-prefill rather than one each.
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
            # A batch wider than any this request has run needs a new one: after
            # `reset_state`, OpenVINO 2026.4's CPU plugin kept the rows beyond the old width
            # wrong once the cache grew (measured: those rows' text diverged after ≈ 7 tokens).
            self._request = self.compiled.create_infer_request()
            self._request_rows = rows
        return self._request

    def _prefill(self, going: list[_Row], joining: list[Request]) -> None:
        """A new batch, or the running one with `joining` added: a request that joins cannot
        take a row of the cache as it is (every row is at the same position), so the batch is
        prefilled again, each running row with its prompt and the tokens it has generated so
        far, the newcomers with their prompts (vLLM's recomputation, used here to join instead
        of to preempt). Rows keep their sampling state, so a running request goes on as if
        nothing happened; `joinable` bounds what that costs."""
        width = len(going) + len(joining)
        longest = max([len(row.context) for row in going] + [len(r.prompt_ids) for r in joining])
        self._rows = [*going, *(_Row(r, width * longest) for r in joining)]
        self._logits, self._mask = _prefill(self._request_for(width), [row.context for row in self._rows])

    def _decode(self, going: list[_Row]) -> None:
        """One decode step of the rows still going: each row's last token in, gathered from
        the last pass's rows of the cache."""
        keep = np.asarray([k for k, row in enumerate(self._rows) if not row.ended])
        mask = np.concatenate([self._mask[keep], np.ones((len(keep), 1), dtype=np.int64)], axis=1)
        inputs = {
            "input_ids": np.asarray([[row.context[-1]] for row in going], dtype=np.int64),
            "attention_mask": mask,
            "position_ids": np.asarray([[len(row.context) - 1] for row in going], dtype=np.int64),
            "beam_idx": keep.astype(np.int32),
        }
        self._rows = going
        request = self._request_for(len(going))
        request.infer(inputs)
        self._mask = mask
        self._logits = request.get_tensor("logits").data[:, -1]

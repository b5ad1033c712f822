"""Continuous batching for the torch engine: transformers' own (`init_continuous_batching`: a
paged KV cache in fixed blocks, a scheduler that admits a request into the running batch at any
step and splits long prefills, ragged batches with no padding), with every token picked by the
engine's seeded `Sampler`.

The library samples a whole batch with one generator; a request's `seed` would then depend on
its neighbours, and its penalties, `logit_bias` and logprobs would not be applied at all. So
the library's last logits processor is the engine's, and hands the library a row that is -inf
everywhere but the chosen token, which the library's greedy pick then takes. It samples the
plain rows (temperature, top-k/p, min-p, greedy) together on the logits' device, each from its
own request's draw (`row_sampling.py`), with tensor operations alone, so that on a GPU the
library replays each step from a CUDA graph; the other rows are picked after the step with
their request's `Sampler` on the host (a device→host copy of those rows). Either way a seed
gives the same tokens as the one-request path and the OpenVINO engine's start tier."""

from __future__ import annotations

import math
import queue
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
from transformers import GenerationConfig
from transformers.generation.configuration_utils import ContinuousBatchingConfig
from transformers.generation.continuous_batching.cb_logits_processors import (
    ContinuousBatchingLogitsProcessor,
    ContinuousBatchingLogitsProcessorList,
)
from transformers.generation.logits_process import LogitsProcessorList

from services.engine.batch_types import Step, check_fits, merged
from services.engine.sampling import Sampler, token_logprob
from services.engine.step_gate import StepGate, Turn
from services.engine.torch_engine.engine import TorchEngine
from services.engine.torch_engine.guides import Guided, Guides
from services.engine.torch_engine.row_sampling import ALL, COLUMNS, GREEDY, Branches, RowDraw, fill_table, pick_rows
from shared.messages import FinishReason, SamplingParams, TokenLogprob

BLOCK_TOKENS = 32
"""Tokens per KV block (the library's default, 256, strands up to 255 tokens' worth of cache
per sequence: a crowd of short chats would fill the cache with empty block tails)."""

STEP_TOKENS = 2048
"""Most tokens one step computes: a longer prompt is prefilled in chunks of this many beside
the running decodes. The library claims a block ahead for each chunk, so the cache holds one
more block per chunk of the longest context than the tokens it promises."""


@dataclass
class _Sequence:
    """A request in the batch as the sampler sees it (touched by the library's thread only,
    after `add`)."""

    params: SamplingParams
    sampler: Sampler
    context: list[int]
    deadline: Callable[[int], float]
    guided: Guided | None = None
    """Its structured output's grammar (`guides.py`), None without one."""
    error: str = ""
    """Picking its token failed (set by the library's thread; the request then fails alone)."""
    ends: bool = False
    """Its last pick ended it (max_tokens, or an end of sequence): no deadline is posted for it."""
    logprobs: list[TokenLogprob | None] = field(default_factory=list)
    """One per token picked, in order (read by the worker's thread as the tokens arrive)."""

    @property
    def on_device(self) -> bool:
        """Its token depends on the logits and its draw alone (`row_sampling.py`)."""
        return self.guided is None and self.params.logprobs < 0 and self.sampler.plain


class EngineSampling(ContinuousBatchingLogitsProcessor):
    """The library's per-step logits processor that picks each row's token for its request;
    its per-request argument is the request's slot number.

    A step is three calls on the library's thread. `prepare_tensor_args`, as the step is
    formed: each plain row's settings and its request's draw go into a table on the device.
    `__call__`, inside the forward pass: tensor operations only (`row_sampling.pick_rows` over
    that table), so that the library can capture the step in a CUDA graph and replay it, its
    Python not run again. `after_step`, once the forward pass is done (the batch wraps the
    library's `compute_batch`): the other rows (penalties, bias, logprobs, a grammar) are
    picked on the host from the step's logits and written over the library's output, and every
    row's token is recorded for its request.

    It also holds the node's headroom gate (`step_gate.py`) around each step, as the
    one-request path does around each token: the library's thread waits for its turn as it
    forms a step (before the forward pass) and leaves once the step's tokens are picked,
    posted with the deadline of the batch's next token, or not at all when no request goes on.
    Every gate call is made under `lock`, which `forget` takes too, so a cancel from the
    worker's thread can never leave a posting behind."""

    def __init__(
        self,
        eos_ids: frozenset[int],
        vocab: int,
        max_rows: int,
        device: torch.device,
        graphed: bool = False,
        gate: StepGate | None = None,
        gate_slot: int = -1,
    ) -> None:
        self.supported_kwargs = {"slot": int}
        self.ignored_kwargs = ()
        self.eos_ids = eos_ids
        """The model's ends of sequence (a pick of one ends its request unless it ignores them)."""
        self.vocab = vocab
        self.graphed = graphed
        """Steps are replayed from CUDA graphs: every step takes every branch of the sampler,
        and keeps its logits in `logits` for the rows picked on the host."""
        self.sequences: dict[int, _Sequence] = {}
        self.gate = gate if gate is not None and gate_slot >= 0 else None
        self.gate_slot = gate_slot
        self._turn: tuple[ExitStack, Turn] | None = None
        """The gate turn the library's thread holds (entered and not left)."""
        self.waited = 0.0
        """Seconds the library's thread has waited for the gate, in all."""
        self.lock = threading.Lock()
        self.rows = 0
        """Rows of the step being formed that get a token: the library puts them first; the
        logits' other rows (a prompt's chunk that ends no prefill) are dropped."""
        self.slots: list[int] = []
        """The request (slot) of each of those rows."""
        self.host_rows: list[int] = []
        """Those of them picked on the host, after the forward pass."""
        self.branches = ALL
        self.pending = False
        """A step was formed and its tokens are not recorded yet."""
        self.hook: Callable[[], None] | None = None
        """Called once, on the library's thread, before its first step (`ContinuousBatcher._hook`)."""
        pinned = device.type == "cuda"
        self.staging = torch.zeros((COLUMNS, max_rows), dtype=torch.float64, pin_memory=pinned)
        self.table = self.staging.to(device)
        """Each row's settings and draw (`row_sampling.py`), read by the step on the device."""
        self.logits = torch.zeros((max_rows, vocab), dtype=torch.float32, device=device) if graphed else None
        self.step_logits: torch.Tensor | None = None
        """The step's logits (eager steps: the library's own tensor, held until `after_step`)."""
        self.threads = 0
        """Runtime threads the library's thread runs on (set there: torch keeps a count per
        thread); 0: as it is."""
        self.closing = False
        """The batch is being stopped: its last steps pass no gate."""

    @property
    def holding(self) -> bool:
        """The library's thread holds a gate turn."""
        return self._turn is not None

    def fill_defaults(self, int32_tensor: torch.Tensor) -> None:
        int32_tensor.fill_(-1)

    def prepare_tensor_args(self, requests_with_new_token: list) -> torch.Tensor:  # type: ignore[type-arg]
        if self.hook is not None:
            self.hook()
            self.hook = None
        self.slots = [r.state.logit_processor_kwargs.get("slot", -1) for r in requests_with_new_token]
        self.rows = len(self.slots)
        if self.threads and torch.get_num_threads() != self.threads:
            torch.set_num_threads(self.threads)
        sequences = [self.sequences.get(slot) for slot in self.slots]
        self.host_rows = [row for row, seq in enumerate(sequences) if seq is not None and not seq.on_device]
        draws = [GREEDY if seq is None or not seq.on_device else RowDraw.of(seq.sampler) for seq in sequences]
        fill_table(self.staging, draws)
        self.table.copy_(self.staging)  # waits for the copy: the step reads it on another stream
        self.branches = ALL if self.graphed else Branches.of(draws, self.vocab)
        self.pending = True
        self._enter()
        return torch.tensor(self.slots, dtype=torch.int32, device="cpu")

    def __call__(self, scores: torch.FloatTensor, tensor_arg: torch.Tensor) -> torch.FloatTensor:
        # Tensor operations alone: under a CUDA graph this runs once, at capture.
        n = scores.size(0) if self.graphed else min(self.rows, scores.size(0))
        if self.logits is not None:
            self.logits[:n].copy_(scores[:n])
        else:
            self.step_logits = scores
        tokens = pick_rows(scores[:n], self.table, self.branches)
        picked = torch.full_like(scores, -math.inf)  # the rows past n are the library's to drop
        picked[:n].scatter_(1, tokens.unsqueeze(1), 0.0)
        return picked  # type: ignore[return-value]

    def after_step(self, output_ids: torch.Tensor, stream: torch.cuda.Stream | None) -> None:
        """The step's forward pass is done (or queued on `stream`): pick the host's rows into
        the library's `output_ids`, and record every row's token for its request."""
        if not self.pending:  # a step the library ran without forming one (a warm-up)
            return
        self.pending = False
        if stream is not None:
            stream.synchronize()
        if self.host_rows:
            logits = self.logits if self.logits is not None else self.step_logits
            assert logits is not None
            host = logits[self.host_rows].detach().float().cpu().numpy()  # one copy for those rows
            picks = [self._pick(self.slots[row], host[i]) for i, row in enumerate(self.host_rows)]
            output_ids[0, self.host_rows] = torch.tensor(picks, dtype=output_ids.dtype).to(output_ids.device)
        self.step_logits = None
        tokens: list[int] = output_ids[0, : self.rows].tolist()
        picked_on_host = set(self.host_rows)
        for row, (slot, token) in enumerate(zip(self.slots, tokens, strict=True)):
            seq = self.sequences.get(slot)
            if seq is not None and row not in picked_on_host:
                seq.sampler.record(token)
                self._record(seq, token, None)
        self._leave()

    def _pick(self, slot: int, logits: npt.NDArray[np.float32]) -> int:
        """The row's token, picked by its request's sampler (and grammar), recorded for it."""
        seq = self.sequences.get(slot)
        if seq is None:  # cancelled since this step was formed: any token, it is dropped
            return int(logits.argmax())
        try:
            masked = logits if seq.guided is None else seq.guided.mask(logits)
            token = seq.sampler.pick(masked, seq.context)
            if seq.guided is not None:
                seq.guided.accept(token)
            logprob = None
            if seq.params.logprobs >= 0 and seq.sampler.adjusted is not None:
                logprob = token_logprob(seq.sampler.adjusted, token, seq.params.logprobs)
        except Exception as e:  # this request fails (at its next result); the batch goes on
            seq.error = f"{type(e).__name__}: {e}"
            seq.ends = True
            return int(logits.argmax())
        self._record(seq, token, logprob)
        return token

    def _record(self, seq: _Sequence, token: int, logprob: TokenLogprob | None) -> None:
        seq.context.append(token)
        seq.logprobs.append(logprob)
        seq.ends = len(seq.logprobs) >= seq.params.max_tokens or (token in self.eos_ids and not seq.params.ignore_eos)

    def _deadline(self) -> float:
        going = [s.deadline(len(s.logprobs)) for s in list(self.sequences.values()) if not s.ends]
        return min(going, default=math.inf)

    def _enter(self) -> None:
        if self.gate is None or self.closing:
            return
        with self.lock:
            self._end_turn(math.inf)  # a step formed with no token to pick (a prefill chunk)
            deadline = self._deadline()
        # The turn spans two of the library's calls (formed here, left in `after_step`).
        stack = ExitStack()
        turn = stack.enter_context(
            self.gate.turn(self.gate_slot, deadline if math.isfinite(deadline) else time.monotonic())
        )
        self.waited += turn.waited
        with self.lock:
            self._turn = (stack, turn)
            if self.closing:  # released while it waited: hold nothing past the stop
                self._end_turn(math.inf)
                self.gate.idle(self.gate_slot)

    def _end_turn(self, then: float) -> None:
        """Leave the turn held, if any, posted with `then` (under `lock`)."""
        if self._turn is not None:
            (stack, turn), self._turn = self._turn, None
            turn.then = then
            stack.close()

    def aside(self, wait: Callable[[], None]) -> None:
        """Run `wait` (this step's forward pass waiting for its tensors' copy, TIDAL §5) out of
        the node's gate: other instances step meanwhile, and this one takes a turn again after."""
        with self.lock:
            held = self._turn is not None
            self._end_turn(math.inf)  # not waiting for a turn either
        wait()  # a copy that failed fails the step: no turn is taken again for it
        if held:
            self._enter()

    def _leave(self) -> None:
        if self.gate is None:
            return
        with self.lock:
            self._end_turn(self._deadline())

    def release(self) -> None:
        """Give back whatever this batch holds of the gate (its thread is gone or going)."""
        with self.lock:
            self.closing = True
            self._end_turn(math.inf)
            if self.gate is not None:
                self.gate.idle(self.gate_slot)

    def forget(self, slot: int) -> None:
        """A request left the batch (ended, failed or cancelled): when it was the last, take
        the worker's posting down."""
        with self.lock:
            self.sequences.pop(slot, None)
            if self.gate is not None and self._turn is None and not self.sequences:
                self.gate.idle(self.gate_slot)


class ContinuousBatcher:
    """One model's continuous batch: `add` requests, read their `steps`, `cancel`, `close`."""

    def __init__(
        self,
        engine: TorchEngine,
        max_batch: int,
        kv_tokens: int,
        gate: StepGate | None = None,
        gate_slot: int = -1,
        graphs: bool | tuple[bool, bool] | None = None,
    ) -> None:
        """`graphs`: replay steps from CUDA graphs (the library's, captured per padded shape at
        its first use), or (prefill steps, decode steps) for each kind apart; None: where the
        model is on a CUDA device."""
        self.device = engine.device
        if graphs is None:
            graphs = engine.device.type == "cuda"
        graphed = any(graphs) if isinstance(graphs, tuple) else graphs
        vocab = int(engine.model.config.vocab_size)
        self.sampling = EngineSampling(engine.eos_ids, vocab, max_batch, engine.device, graphed, gate, gate_slot)
        self.sampling.hook = self._hook
        self.eos_ids = sorted(engine.eos_ids)
        self.guides = Guides(engine.tokenizer, vocab, self.eos_ids)
        generation = GenerationConfig(do_sample=False, max_new_tokens=16, eos_token_id=self.eos_ids)
        self.kv_tokens = kv_tokens
        """The longest prompt + completion it takes (a longer one alone would stop the library:
        it has nothing to evict to make room)."""
        blocks = -(-kv_tokens // BLOCK_TOKENS) + -(-kv_tokens // STEP_TOKENS) + 1
        config = ContinuousBatchingConfig(
            block_size=BLOCK_TOKENS,
            num_blocks=blocks,
            max_batch_tokens=STEP_TOKENS,
            max_requests_per_batch=max_batch,
            max_memory_percent=0.9,
            use_cuda_graph=graphs,
            use_async_batching=False,
        )
        model: Any = engine.model  # transformers' continuous-batching mixin is untyped
        self.manager = model.init_continuous_batching(generation_config=generation, continuous_batching_config=config)
        # The engine's sampler replaces whatever the generation config would have made (nothing,
        # with do_sample=False): it is the one processor, with one int per request.
        processors = ContinuousBatchingLogitsProcessorList(LogitsProcessorList([self.sampling]))
        processors.tensors_required = 1
        self.manager.logit_processor = processors
        if engine.fill is not None:  # its tensors stream in behind its first forward pass
            engine.fill.around = self.sampling.aside
        self._slots: dict[str, int] = {}
        self._seen: dict[str, int] = {}
        """Tokens of each request already handed out by `steps`."""
        self._next_slot = 0
        self.manager.start()

    def _hook(self) -> None:
        """Run `EngineSampling.after_step` after each forward pass (on the library's thread, at
        its first step: the library makes its step runner there). The runner's `compute_batch`
        is wrapped on the instance; transformers is pinned (`constraints.txt`)."""
        processor: Any = self.manager.batch_processor
        runner = processor.model_runner
        compute = runner.compute_batch

        def compute_batch(model: Any, batch_data: dict[str, Any]) -> None:
            compute(model, batch_data)
            io = processor.inputs_and_outputs
            _, _, output_ids = io.get_cb_kwargs()
            self.sampling.after_step(output_ids, io.compute_stream)

        runner.compute_batch = compute_batch

    @property
    def active(self) -> int:
        return len(self._slots)

    @property
    def waited(self) -> float:
        return self.sampling.waited

    @property
    def alive(self) -> bool:
        """Its thread runs (an error inside the library ends it, and every request with it)."""
        return bool(self.manager.is_running())

    def set_threads(self, threads: int) -> None:
        """The runtime threads its steps run on, from the next step."""
        self.sampling.threads = threads

    @property
    def kv_bytes(self) -> int:
        """The library's paged KV cache (made on its thread at its first step; 0 before): the
        whole allocation, as it is made at once, whatever the requests fill."""
        processor: Any = self.manager.batch_processor
        cache = getattr(processor, "cache", None)
        if cache is None:
            return 0
        return sum(t.numel() * t.element_size() for t in (*cache.key_cache, *cache.value_cache))

    def device_bytes(self) -> int:
        """What torch's caching allocator holds on the model's GPU: the KV cache, activations,
        the CUDA graphs' pools, and the weights of a worker with an arena of its own (the
        node's arena is the extension's memory, outside it); 0 on the host. The process's
        CUDA context is not in it."""
        return int(torch.cuda.memory_reserved(self.device)) if self.device.type == "cuda" else 0

    def add(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        deadline: Callable[[int], float] = lambda _: math.inf,
        kv_tokens: int = 0,
    ) -> None:
        if not self.manager.is_running():
            raise RuntimeError("the continuous batch has stopped")
        check_fits(len(prompt_ids), params.max_tokens, self.kv_tokens)
        slot = self._next_slot
        self._next_slot += 1
        guided = self.guides.start(params.guide) if params.guide is not None else None
        self.sampling.sequences[slot] = _Sequence(params, Sampler.of(params), list(prompt_ids), deadline, guided)
        self._slots[request_id] = slot
        self._seen[request_id] = 0
        self.manager.add_request(
            list(prompt_ids),
            request_id=request_id,
            max_new_tokens=params.max_tokens,
            streaming=True,
            eos_token_id=-1 if params.ignore_eos else self.eos_ids,
            slot=slot,
        )

    def cancel(self, request_id: str) -> None:
        if request_id in self._slots:
            self.manager.cancel_request(request_id)
            self._forget(request_id)

    def steps(self, timeout: float) -> list[Step]:
        """Every request's progress since the last call, waiting up to `timeout` for the first."""
        out: dict[str, Step] = {}
        wait: float | None = timeout
        while True:
            outputs = self.manager.output_router.output_queue
            try:
                result = outputs.get(timeout=wait) if wait else outputs.get_nowait()
            except queue.Empty:
                break
            wait = None
            step = self._step(result)
            if step is None:
                continue
            before = out.get(step.request_id)
            if before is not None:  # two results of one request in one look: one step
                step = merged(before, step)
            out[step.request_id] = step
        if not self.manager.is_running():  # the library's thread died (its log says why)
            self.sampling.release()
            for rid in list(self._slots):
                out[rid] = Step(rid, (), None, "the continuous batch stopped")
                self._forget(rid)
        return list(out.values())

    def _step(self, result: object) -> Step | None:
        rid: str = result.request_id  # type: ignore[attr-defined]
        slot = self._slots.get(rid)
        if slot is None:  # cancelled
            return None
        seq = self.sampling.sequences[slot]
        if result.error is not None or seq.error:  # type: ignore[attr-defined]
            self.manager.cancel_request(rid)
            self._forget(rid)
            return Step(rid, (), None, seq.error or str(result.error))  # type: ignore[attr-defined]
        tokens: list[int] = list(result.generated_tokens)  # type: ignore[attr-defined]
        finished = result.is_finished()  # type: ignore[attr-defined]
        finish = None
        if finished:
            if tokens and tokens[-1] in self.sampling.eos_ids and not seq.params.ignore_eos:
                tokens.pop()  # the end of sequence ends it; it is not part of the text
                finish = FinishReason.STOP
            else:
                finish = FinishReason.LENGTH if len(tokens) >= seq.params.max_tokens else FinishReason.STOP
        seen = self._seen[rid]
        new = tuple((t, seq.logprobs[i]) for i, t in enumerate(tokens[seen:], start=seen))
        self._seen[rid] = max(seen, len(tokens))
        if finished:
            self._forget(rid)
        return Step(rid, new, finish)

    def _forget(self, request_id: str) -> None:
        slot = self._slots.pop(request_id, None)
        self._seen.pop(request_id, None)
        if slot is not None:
            self.sampling.forget(slot)

    def close(self) -> None:
        """Stop the library's thread (requests still running end with it) and free the cache."""
        self.sampling.release()  # its last steps pass no gate, and it holds none
        self.manager.stop(block=True, timeout=30, hard_stop=True)
        for rid in list(self._slots):
            self._forget(rid)

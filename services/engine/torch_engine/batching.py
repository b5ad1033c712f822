"""Continuous batching for the torch engine: transformers' own (a paged KV cache, requests admitted
at any step, long prefills chunked), with every token picked by the engine's seeded `Sampler`:
the library samples a batch with one generator (a `seed` would depend on the neighbours) and has
no penalties, `logit_bias` or logprobs. Its last logits processor is ours: plain rows are sampled
together on the device (`row_sampling.py`, CUDA-graph safe), the others on the host after the
step (`guides.Row`); either way a seed gives the one-request path's tokens."""

from __future__ import annotations

import itertools
import math
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
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

from services.engine.batch_types import AdapterLoad, Step, check_fits
from services.engine.step_gate import StepGate, Turns, no_turn, post
from services.engine.torch_engine.engine import TorchEngine
from services.engine.torch_engine.guides import Guides, Row
from services.engine.torch_engine.lora import LoraShape, RowLoras, unwrap
from services.engine.torch_engine.row_sampling import ALL, COLUMNS, GREEDY, Branches, RowDraw, fill_table, pick_rows
from shared.adapters import AdapterArtifact, read_manifest
from shared.messages import AdapterRef, FinishReason, SamplingParams

BLOCK_TOKENS = 32
"""Tokens per KV block (the library's 256 would strand up to 255 tokens of cache per sequence:
a crowd of short chats would fill the cache with empty block tails)."""

STEP_TOKENS = 2048
"""Most tokens one step computes: a longer prompt is prefilled in chunks beside the decodes (the
library claims a block ahead for each chunk)."""


@dataclass
class _Sequence:
    """A batch slot's request: its host `Row` (shared with the pipeline and the one-request path)
    and what the batch keeps beside it."""

    row: Row
    deadline: Callable[[int], float] = lambda _: math.inf
    error: str = ""
    """Its pick failed (on the library's thread): it fails alone at its next result."""
    seen: int = 0
    """Tokens `steps` handed out."""
    adapter: int = -1
    """Its adapter's slot (`lora.RowLoras`); -1: the base."""

    @property
    def ends(self) -> bool:
        return self.row.finish is not None or bool(self.error)

    @property
    def on_device(self) -> bool:
        row = self.row
        return row.guide is None and row.params.logprobs < 0 and row.sampler.plain


class EngineSampling(ContinuousBatchingLogitsProcessor):
    """The library's logits processor (its argument: the request's slot). A step is three calls on
    the library's thread: `prepare_tensor_args` as it is formed (the device rows' table), `__call__`
    in the forward pass (CUDA-graph safe), `after_step` (the host rows' picks); the pass and the
    picks run in one turn of the node's headroom gate (`turn`)."""

    def __init__(
        self,
        vocab: int,
        max_rows: int,
        device: torch.device,
        graphed: bool = False,
        gate: StepGate | None = None,
        gate_slot: int = -1,
    ) -> None:
        self.supported_kwargs = {"slot": int}
        self.ignored_kwargs = ()
        self.vocab = vocab
        self.graphed = graphed
        self.sequences: dict[int, _Sequence] = {}
        self.gate = on = gate if gate is not None and gate_slot >= 0 else None
        self.gate_slot = gate_slot
        self.turns = Turns(no_turn if on is None else lambda deadline: on.turn(gate_slot, deadline))
        self.holding = False
        """The library's thread is in a turn (left and taken back around a copy's wait, `aside`)."""
        self.lock = threading.Lock()
        """Taken by the library's thread as it leaves a turn and by `forget`: a cancel from the
        worker's thread never leaves a posting behind."""
        self.slots: list[int] = []
        """Each row's request, for the rows that get a token (the library puts them first)."""
        self.host_rows: list[int] = []
        self.branches = ALL
        self.pending = False
        """A step was formed and its tokens are not recorded yet."""
        self.hook: Callable[[], None] | None = None
        """Run once, on the library's thread, before its first step."""
        self.staging = torch.zeros((COLUMNS, max_rows), dtype=torch.float64, pin_memory=device.type == "cuda")
        self.table = self.staging.to(device)
        self.logits = torch.zeros((max_rows, vocab), dtype=torch.float32, device=device) if graphed else None
        """A graph's copy of the step's logits, or the eager step's own (until `after_step`)."""
        self.threads = 0
        """Runtime threads for the library's thread (torch counts them per thread); 0: as it is."""
        self.closing = False
        """Its last steps pass no gate."""

    def fill_defaults(self, int32_tensor: torch.Tensor) -> None:
        int32_tensor.fill_(-1)

    def prepare_tensor_args(self, requests_with_new_token: list) -> torch.Tensor:  # type: ignore[type-arg]
        if self.hook is not None:
            self.hook()
            self.hook = None
        self.slots = [r.state.logit_processor_kwargs.get("slot", -1) for r in requests_with_new_token]
        if self.threads and torch.get_num_threads() != self.threads:
            torch.set_num_threads(self.threads)
        sequences = [self.sequences.get(slot) for slot in self.slots]
        self.host_rows = [row for row, seq in enumerate(sequences) if seq is not None and not seq.on_device]
        draws = [RowDraw.of(seq.row.sampler) if seq is not None and seq.on_device else GREEDY for seq in sequences]
        fill_table(self.staging, draws)
        self.table.copy_(self.staging)  # waits for the copy: the step reads it on another stream
        self.branches = ALL if self.graphed else Branches.of(draws, self.vocab)
        self.pending = True
        return torch.tensor(self.slots, dtype=torch.int32, device="cpu")

    def __call__(self, scores: torch.FloatTensor, tensor_arg: torch.Tensor) -> torch.FloatTensor:
        # Tensor operations alone: under a CUDA graph this runs once, at capture.
        n = scores.size(0) if self.graphed else min(len(self.slots), scores.size(0))
        if self.logits is not None and self.graphed:
            self.logits[:n].copy_(scores[:n])
        else:
            self.logits = scores
        tokens = pick_rows(scores[:n], self.table, self.branches)
        picked = torch.full_like(scores, -math.inf)  # the rows past n are the library's to drop
        picked[:n].scatter_(1, tokens.unsqueeze(1), 0.0)
        return picked  # type: ignore[return-value]

    def after_step(self, output_ids: torch.Tensor, stream: torch.cuda.Stream | None) -> None:
        if not self.pending:  # a step the library ran without forming one (a warm-up)
            return
        self.pending = False
        if stream is not None:
            stream.synchronize()
        if self.host_rows:
            assert self.logits is not None
            host = self.logits[self.host_rows].detach().float().cpu().numpy()  # one copy for those rows
            picks = [self._pick(self.slots[row], host[i]) for i, row in enumerate(self.host_rows)]
            output_ids[0, self.host_rows] = torch.tensor(picks, dtype=output_ids.dtype).to(output_ids.device)
        if not self.graphed:
            self.logits = None
        tokens: list[int] = output_ids[0, : len(self.slots)].tolist()
        on_host = set(self.host_rows)
        for row, (slot, token) in enumerate(zip(self.slots, tokens, strict=True)):
            seq = self.sequences.get(slot)
            if seq is not None and row not in on_host:
                seq.row.sampler.record(token)
                seq.row.took(token)

    def _pick(self, slot: int, logits: npt.NDArray[np.float32]) -> int:
        seq = self.sequences.get(slot)
        if seq is None:  # cancelled since this step was formed: any token, it is dropped
            return int(logits.argmax())
        try:
            return seq.row.pick(logits)
        except Exception as e:  # this request fails (at its next result); the batch goes on
            seq.error = f"{type(e).__name__}: {e}"
            return int(logits.argmax())

    def _deadline(self) -> float:
        going = [s.deadline(len(s.row.logprobs)) for s in list(self.sequences.values()) if not s.ends]
        return min(going, default=math.inf)

    @contextmanager
    def turn(self) -> Iterator[None]:
        """A formed step (not a warm-up, nor one of a batch stopping) in a turn of the gate; once
        none of its requests goes on (or a cancel took the last meanwhile) the posting comes down."""
        if self.gate is None or self.closing or not self.pending:
            yield
            return
        try:
            with self.turns(self._due()) as held:
                self.holding = True
                yield
                post(held, [self._deadline()])
        finally:
            with self.lock:
                self.holding = False
                if self.closing or math.isinf(self._deadline()):
                    self.gate.idle(self.gate_slot)

    def _due(self) -> float:
        deadline = self._deadline()
        return deadline if math.isfinite(deadline) else time.monotonic()

    def aside(self, wait: Callable[[], None]) -> None:
        """Run `wait` (the forward pass waiting for its tensors' copy, TIDAL §5) out of the gate,
        so other instances step meanwhile; a copy that failed takes no turn again."""
        gate = self.gate
        with self.lock:
            held, self.holding = self.holding, False
            if held and gate is not None:
                gate.leave(self.gate_slot)
        wait()
        if held and gate is not None:
            t0 = time.monotonic()
            gate.enter(self.gate_slot, self._due())
            self.turns.waited += time.monotonic() - t0
            self.holding = True

    def release(self) -> None:
        """Give back whatever this batch holds of the gate (its thread is gone or going)."""
        with self.lock:
            self.closing = True
            if self.gate is not None:
                self.gate.idle(self.gate_slot)

    def forget(self, slot: int) -> None:
        """A request left the batch: when it was the last, take the worker's posting down."""
        with self.lock:
            self.sequences.pop(slot, None)
            if self.gate is not None and not self.holding and not self.sequences:
                self.gate.idle(self.gate_slot)


class _Processors(ContinuousBatchingLogitsProcessorList):
    """The library's processor list, which also fills the step's adapter table as it forms the
    step (its tokens are packed in `requests_in_batch`'s order)."""

    def __init__(self, sampling: EngineSampling, loras: RowLoras | None) -> None:
        super().__init__(LogitsProcessorList([sampling]))
        self.tensors_required = 1
        self.sampling = sampling
        self.loras = loras

    def prepare_tensor_args(self, requests_in_batch: list, arg_storage: torch.Tensor) -> torch.Tensor:  # type: ignore[type-arg]
        if self.loras is not None:
            sequences = self.sampling.sequences
            rows = []
            for r in requests_in_batch:
                seq = sequences.get(r.state.logit_processor_kwargs.get("slot", -1))
                rows.append((seq.adapter if seq is not None else -1, r.query_length))
            self.loras.fill(rows)
        return super().prepare_tensor_args(requests_in_batch, arg_storage)


@dataclass(frozen=True)
class _Pending:
    """A request waiting: an adapter's for a slot, or any behind one for which the batch drains
    to be built again (`adapter` None: the base's)."""

    request_id: str
    prompt_ids: Sequence[int]
    params: SamplingParams
    deadline: Callable[[int], float]
    adapter: AdapterRef | None = None
    kept: AdapterArtifact | None = None


class ContinuousBatcher:
    def __init__(
        self,
        engine: TorchEngine,
        max_batch: int,
        kv_tokens: int,
        gate: StepGate | None = None,
        gate_slot: int = -1,
        graphs: bool | tuple[bool, bool] | None = None,
        lora: LoraShape | None = None,
    ) -> None:
        """`graphs`: replay steps from the library's CUDA graphs, or (prefill, decode) apart;
        None: where the model is on a CUDA device. `lora`: built LoRA-able for adapters of that
        shape (each row its own, `lora.py`); an adapter past it waits for the batch to drain."""
        self.engine = engine
        self.device = engine.device
        if graphs is None:
            graphs = engine.device.type == "cuda"
        self.graphs = graphs
        graphed = any(graphs) if isinstance(graphs, tuple) else graphs
        vocab = int(engine.model.config.vocab_size)
        self.max_batch = max_batch
        self.sampling = EngineSampling(vocab, max_batch, engine.device, graphed, gate, gate_slot)
        self.eos_ids = sorted(engine.eos_ids)
        self.guides = Guides(engine.tokenizer, vocab, self.eos_ids)
        self.kv_tokens = kv_tokens
        self._slots: dict[str, int] = {}
        self._next_slot = itertools.count()
        self._pending: list[_Pending] = []
        self._draining: str | None = None
        """A loaded adapter whose slot another waits for: its new requests wait meanwhile."""
        self._loads: dict[str, AdapterLoad] = {}
        """Requests whose adapter was read for them, told with their next step."""
        self._start(lora)

    def _start(self, lora: LoraShape | None) -> None:
        """The library's manager on the model (its linears wrapped for `lora`), started."""
        self.loras = RowLoras(self.engine.model, lora, STEP_TOKENS) if lora is not None else None
        if lora is None:
            unwrap(self.engine.model)
        self.sampling.hook = self._hook
        self.sampling.closing = False
        config = ContinuousBatchingConfig(
            block_size=BLOCK_TOKENS,
            num_blocks=-(-self.kv_tokens // BLOCK_TOKENS) + -(-self.kv_tokens // STEP_TOKENS) + 1,
            max_batch_tokens=STEP_TOKENS,
            max_requests_per_batch=self.max_batch,
            max_memory_percent=0.9,
            use_cuda_graph=self.graphs,
            use_async_batching=False,
        )
        generation = GenerationConfig(do_sample=False, max_new_tokens=16, eos_token_id=self.eos_ids)
        model: Any = self.engine.model  # transformers' continuous-batching mixin is untyped
        self.manager = model.init_continuous_batching(generation_config=generation, continuous_batching_config=config)
        # The engine's sampler is the one processor (do_sample=False makes none), one int a request.
        self.manager.logit_processor = _Processors(self.sampling, self.loras)
        if self.engine.fill is not None:  # its tensors stream in behind its first forward pass
            self.engine.fill.around = self.sampling.aside
        self.manager.start()

    def _hook(self) -> None:
        """Wrap the runner's `compute_batch` (made on the library's thread at its first step;
        transformers is pinned, `constraints.txt`) in a gate's turn, with `after_step` in it."""
        processor: Any = self.manager.batch_processor
        runner = processor.model_runner
        compute = runner.compute_batch

        def compute_batch(model: Any, batch_data: dict[str, Any]) -> None:
            with self.sampling.turn():
                compute(model, batch_data)
                io = processor.inputs_and_outputs
                self.sampling.after_step(io.get_cb_kwargs()[2], io.compute_stream)

        runner.compute_batch = compute_batch

    @property
    def active(self) -> int:
        return len(self._slots) + len(self._pending)

    @property
    def waited(self) -> float:
        return self.sampling.turns.waited

    @property
    def alive(self) -> bool:
        return bool(self.manager.is_running())

    def set_threads(self, threads: int) -> None:
        self.sampling.threads = threads

    @property
    def kv_bytes(self) -> int:
        """The library's paged KV cache, allocated whole at its first step (0 before)."""
        cache = getattr(self.manager.batch_processor, "cache", None)
        return 0 if cache is None else sum(t.numel() * t.element_size() for t in (*cache.key_cache, *cache.value_cache))

    def device_bytes(self) -> int:
        """Torch's allocator's on the GPU: KV cache, activations, graph pools (the arena is outside)."""
        return int(torch.cuda.memory_reserved(self.device)) if self.device.type == "cuda" else 0

    def add(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        deadline: Callable[[int], float] = lambda _: math.inf,
        kv_tokens: int = 0,
    ) -> None:
        if not all(map(self._covered, self._pending)):  # behind the drain, in order
            check_fits(len(prompt_ids), params.max_tokens, self.kv_tokens)
            self.guides.start(params.guide)  # a guide the library refuses fails now, alone
            self._pending.append(_Pending(request_id, prompt_ids, params, deadline))
            return
        self._add(request_id, prompt_ids, params, deadline)

    def add_adapted(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        deadline: Callable[[int], float],
        kv_tokens: int,
        adapter: AdapterRef,
    ) -> None:
        """`add` with the request's LoRA adapter: read into a slot at its first request; it
        waits while every slot is in use, or for the batch to drain where the batch was not
        built for its linears or rank (then it is built again for them)."""
        if not self.alive:
            raise RuntimeError("the continuous batch has stopped")
        check_fits(len(prompt_ids), params.max_tokens, self.kv_tokens)
        kept = read_manifest(Path(adapter.path))
        if kept is None:
            raise ValueError(f"the adapter `{adapter.name}` is missing from the store ({adapter.path})")
        self.guides.start(params.guide)  # a guide the library refuses fails now, alone
        self._pending.append(_Pending(request_id, prompt_ids, params, deadline, adapter, kept))
        self._admit_pending()

    def drop_adapter(self, name: str) -> None:
        """Its keep-alive passed with none of its requests here: its slot is free."""
        if self.loras is not None:
            self.loras.free(name)

    def _admit_pending(self) -> None:
        """The waiting requests that can run now into the batch: the base's and those of an
        adapter in a slot go on; one whose adapter finds no slot waits, and the loaded adapter
        with the fewest rows takes no new ones until its slot frees for it (no adapter waits
        for ever behind busier ones). Behind one the batch was not built for, every request
        waits, in order; drained, the batch is built again for them."""
        if self._pending and not self._slots and not all(map(self._covered, self._pending)):
            shape = self.loras.shape if self.loras is not None else LoraShape(frozenset(), 0)
            for kept in (p.kept for p in self._pending if p.kept is not None):
                shape = LoraShape(shape.targets | set(kept.targets), max(shape.rank, kept.rank))
            self._restart(shape)
        waiting, self._pending = self._pending, []
        rebuild = False
        for p in waiting:
            rebuild = rebuild or not self._covered(p)
            slot = None if rebuild else self._slot_for(p)
            if slot is None:
                self._pending.append(p)
                continue
            self._add(p.request_id, p.prompt_ids, p.params, p.deadline, slot)
        self._draining = self._drain_choice()

    def _drain_choice(self) -> str | None:
        """The loaded adapter that takes no new rows while another waits for a slot: the one
        chosen already while it still has rows, else the one with the fewest."""
        if self.loras is None or all(
            p.adapter is None or self.loras.slot_of(p.adapter.name) is not None for p in self._pending
        ):
            return None
        rows = Counter(s.adapter for s in self.sampling.sequences.values() if s.adapter >= 0)
        names = {slot: name for slot, name in enumerate(self.loras.slots) if name is not None and rows[slot]}
        if self._draining in names.values() or not names:
            return self._draining if names else None
        return names[min(names, key=lambda slot: (rows[slot], slot))]

    def _covered(self, p: _Pending) -> bool:
        if p.kept is None:
            return True
        return self.loras is not None and self.loras.shape.covers(p.kept.targets, p.kept.rank)

    def _slot_for(self, p: _Pending) -> int | None:
        if p.adapter is None:
            return -1
        assert self.loras is not None
        slot = self.loras.slot_of(p.adapter.name)
        if slot is not None:
            return slot if p.adapter.name != self._draining else None
        busy = {s.adapter for s in self.sampling.sequences.values()}
        load = self.loras.load(p.adapter.name, p.adapter.path, p.adapter.scale, busy)
        if load is None:
            return None
        self._loads[p.request_id] = load
        return self.loras.slot_of(p.adapter.name)

    def _restart(self, lora: LoraShape) -> None:
        self.sampling.release()
        self.manager.stop(block=True, timeout=30, hard_stop=True)
        self._start(lora)

    def _add(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        deadline: Callable[[int], float],
        adapter: int = -1,
    ) -> None:
        if not self.alive:
            raise RuntimeError("the continuous batch has stopped")
        check_fits(len(prompt_ids), params.max_tokens, self.kv_tokens)
        slot = next(self._next_slot)
        row = Row(params, list(prompt_ids), self.eos_ids, self.guides.start(params.guide))
        self.sampling.sequences[slot] = _Sequence(row, deadline=deadline, adapter=adapter)
        self._slots[request_id] = slot
        self.manager.add_request(
            list(prompt_ids),
            request_id=request_id,
            max_new_tokens=params.max_tokens,
            streaming=True,
            eos_token_id=-1 if params.ignore_eos else self.eos_ids,
            slot=slot,
        )

    def cancel(self, request_id: str) -> None:
        self._pending = [p for p in self._pending if p.request_id != request_id]
        if request_id in self._slots:
            self.manager.cancel_request(request_id)
            self._forget(request_id)

    def steps(self, timeout: float) -> list[Step]:
        if self._pending:
            try:
                self._admit_pending()
            except Exception as e:  # an adapter unreadable, or a rebuild failed: those requests fail
                failed, self._pending = self._pending, []
                return [Step(p.request_id, (), None, f"{type(e).__name__}: {e}") for p in failed]
        latest: dict[str, Any] = {}  # a result holds all its request's tokens so far: the last says all
        outputs = self.manager.output_router.output_queue
        wait: float | None = timeout
        while True:
            try:
                result = outputs.get(timeout=wait) if wait else outputs.get_nowait()
            except queue.Empty:
                break
            wait = None
            latest[result.request_id] = result
        loads, self._loads = self._loads, {}
        out = {
            s.request_id: replace(s, adapter_load=loads.pop(s.request_id, None))
            for s in map(self._step, latest.values())
            if s is not None
        }
        out.update((rid, Step(rid, (), adapter_load=load)) for rid, load in loads.items())
        if not self.alive:  # the library's thread died (its log says why)
            self.sampling.release()
            for rid in list(self._slots):
                out[rid] = Step(rid, (), None, "the continuous batch stopped")
                self._forget(rid)
        return list(out.values())

    def _step(self, result: Any) -> Step | None:
        rid: str = result.request_id
        slot = self._slots.get(rid)
        if slot is None:  # cancelled
            return None
        seq = self.sampling.sequences[slot]
        if result.error is not None or seq.error:
            self.manager.cancel_request(rid)
            self._forget(rid)
            return Step(rid, (), None, seq.error or str(result.error))
        tokens: list[int] = list(result.generated_tokens)
        finish = None
        if result.is_finished():  # `after_step` recorded how (before the library saw the token)
            self._forget(rid)
            if seq.row.finish is FinishReason.STOP:
                tokens.pop()  # the end of sequence ends it; it is not part of the text
            finish = seq.row.finish or FinishReason.STOP
        new = tuple(zip(tokens[seq.seen :], seq.row.logprobs[seq.seen :], strict=False))
        seq.seen = max(seq.seen, len(tokens))
        return Step(rid, new, finish)

    def _forget(self, request_id: str) -> None:
        slot = self._slots.pop(request_id, None)
        if slot is not None:
            self.sampling.forget(slot)

    def close(self) -> None:
        self.sampling.release()  # its last steps pass no gate, and it holds none
        self.manager.stop(block=True, timeout=30, hard_stop=True)
        for rid in list(self._slots):
            self._forget(rid)

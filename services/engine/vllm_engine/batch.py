"""vLLM behind the worker loop: `VllmBatch`, one model's continuous batch on vLLM's `LLMEngine`
(its v1 core in this process), and `VllmBinding`. vLLM schedules, pages the KV cache, samples
(each request with its own seed), and applies penalties, logit bias and structured output. One
`engine.step()` a `steps` call, on the loop's thread in a turn of the node's gate, so vLLM is
never entered from two threads. A `Load` of another model frees this one's engine and cache.

LoRA adapters (issue 34): vLLM applies each row's own adapter in one step (`LoRARequest`, its
punica kernels, on a CPU too), so requests for several adapters and the base share a batch.
The engine is built LoRA-able where the store keeps adapters for the base, at the rank the
largest needs; an adapter it cannot take (none was kept at its build, or a higher rank) waits
while the batch drains, and the engine is built again for it.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
from vllm import EngineArgs
from vllm import SamplingParams as VllmSamplingParams
from vllm.inputs import TokensPrompt
from vllm.lora.request import LoRARequest
from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams
from vllm.v1.engine.llm_engine import LLMEngine

from services.engine.batch_types import AdapterLoad, Step, check_fits, ends_of_sequence
from services.engine.step_gate import StepGate, Turns, most_urgent, no_turn, post
from services.engine.text import batch_decoder
from services.engine.vllm_engine.params import (
    MAX_LORAS,
    kv_cache_bytes,
    lora_rank,
    sampling_kwargs,
    structured_kwargs,
)
from services.engine.worker_loop import Bound
from services.engine.worker_wire import Load, Loaded, TieredUp
from shared.adapters import adapters_root, read_manifest
from shared.messages import AdapterRef, FinishReason, SamplingParams, Tier, TokenLogprob

_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}

KV_SLACK_TOKENS = 512
"""Cache beyond the tokens promised: vLLM counts whole blocks (up to 128 tokens on a CPU), keeps
one back, and refuses a longest request that would not fit."""


@dataclass
class _Request:
    params: SamplingParams
    deadline: Callable[[int], float]
    generated: int = 0


@dataclass(frozen=True)
class _Waiting:
    """A request held while the batch drains for an engine that takes its adapter."""

    request_id: str
    prompt_ids: Sequence[int]
    params: SamplingParams
    deadline: Callable[[int], float]
    adapter: AdapterRef | None
    rank: int


class VllmBatch:
    """A request vLLM refuses raises at `add`, alone."""

    def __init__(
        self,
        checkpoint: Path,
        max_batch: int,
        kv_tokens: int,
        gate: StepGate | None = None,
        gate_slot: int = -1,
        adapter_ranks: Sequence[int] = (),
    ) -> None:
        """`adapter_ranks`: of the adapters the store keeps for the model (LoRA-able for them)."""
        self.checkpoint = checkpoint
        self.config = json.loads((checkpoint / "config.json").read_text())
        self.max_batch = max_batch
        self.kv_tokens = kv_tokens
        self.max_len = min(kv_tokens, int(self.config.get("max_position_embeddings") or kv_tokens))
        self.lora_rank = lora_rank(adapter_ranks)
        self.engine = self._engine()
        self.tokenizer: Any = self.engine.get_tokenizer()
        self.ends = sorted(ends_of_sequence(self.tokenizer, self.config.get("eos_token_id")))
        self.gate = on = gate if gate is not None and gate_slot >= 0 else None
        self.gate_slot = gate_slot
        self._turns = Turns(no_turn if on is None else lambda deadline: on.turn(gate_slot, deadline))
        self._requests: dict[str, _Request] = {}
        self._error = ""
        self._loras: dict[str, LoRARequest] = {}
        """The adapters loaded in the engine, by name."""
        self._loads: dict[str, AdapterLoad] = {}
        """Requests whose adapter was loaded for them, told with their first step."""
        self._waiting: list[_Waiting] = []

    def _engine(self) -> LLMEngine:
        dtype = str(self.config.get("dtype") or self.config.get("torch_dtype") or "float32")
        lora: dict[str, Any] = (
            {"enable_lora": True, "max_loras": MAX_LORAS, "max_lora_rank": self.lora_rank} if self.lora_rank else {}
        )
        args = EngineArgs(
            model=str(self.checkpoint),
            # The checkpoint's (registration's choice for the node: float32 on a CPU, bfloat16 on a
            # GPU); vLLM's "auto" would run a float32 checkpoint in bfloat16 on a CPU.
            dtype=dtype,
            max_model_len=self.max_len,
            max_num_seqs=max(1, self.max_batch),
            # The cache the node's setting asks for, not a share of the device's memory: the
            # node's reservation station accounts for what its instances hold.
            kv_cache_memory_bytes=kv_cache_bytes(
                self.config, self.kv_tokens + KV_SLACK_TOKENS, _DTYPE_BYTES.get(dtype, 2)
            ),
            seed=0,
            disable_log_stats=True,
            **lora,
        )
        return LLMEngine.from_engine_args(args)

    @property
    def alive(self) -> bool:
        return not self._error  # a step failed, and every request with it

    @property
    def active(self) -> int:
        return len(self._requests)

    def set_threads(self, threads: int) -> None:
        pass  # it steps on the loop's thread, whose count the loop sets

    @property
    def waited(self) -> float:
        return self._turns.waited

    kv_bytes = 0  # vLLM allocates its own: the node's true-up measures this process (its reservation on a GPU)

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
        self.add_adapted(request_id, prompt_ids, params, deadline, kv_tokens, None)

    def add_adapted(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        deadline: Callable[[int], float],
        kv_tokens: int,
        adapter: AdapterRef | None,
    ) -> None:
        if not self.alive:
            raise RuntimeError(f"the vLLM batch has stopped: {self._error}")
        check_fits(len(prompt_ids), params.max_tokens, self.max_len)
        rank = 0
        if adapter is not None and adapter.name not in self._loras:
            kept = read_manifest(Path(adapter.path))
            if kept is None:
                raise ValueError(f"the adapter `{adapter.name}` is missing from the store ({adapter.path})")
            rank = kept.rank
            lora_rank([rank])  # past vLLM's largest: refused now, alone
        if self._waiting or rank > self.lora_rank:  # behind the drain, in order
            self._waiting.append(_Waiting(request_id, prompt_ids, params, deadline, adapter, rank))
            self._requests[request_id] = _Request(params, deadline)
            return
        self._submit(request_id, prompt_ids, params, deadline, adapter)

    def _submit(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        deadline: Callable[[int], float],
        adapter: AdapterRef | None,
    ) -> None:
        structured = StructuredOutputsParams(**structured_kwargs(params.guide)) if params.guide is not None else None
        vllm_params = VllmSamplingParams(
            **sampling_kwargs(params, self.ends),
            structured_outputs=structured,
            output_kind=RequestOutputKind.DELTA,
        )
        prompt = TokensPrompt(prompt_token_ids=list(prompt_ids))
        lora = self._lora(request_id, adapter) if adapter is not None else None
        self.engine.add_request(request_id, prompt, vllm_params, lora_request=lora)
        self._requests[request_id] = _Request(params, deadline)

    def _lora(self, request_id: str, adapter: AdapterRef) -> LoRARequest:
        """The adapter's request, loaded into the engine at its first use (its cold start)."""
        lora = self._loras.get(adapter.name)
        if lora is None:
            used = {r.lora_int_id for r in self._loras.values()}
            lora = LoRARequest(adapter.name, min(set(range(1, len(used) + 2)) - used), adapter.path)
            t0 = time.monotonic()
            self.engine.add_lora(lora)
            self._loras[adapter.name] = lora
            self._loads[request_id] = AdapterLoad(adapter.name, time.monotonic() - t0, 0.0)
        return lora

    def drop_adapter(self, name: str) -> None:
        lora = self._loras.pop(name, None)
        if lora is not None:
            self.engine.remove_lora(lora.lora_int_id)

    def cancel(self, request_id: str) -> None:
        if self._requests.pop(request_id, None) is not None:
            if any(w.request_id == request_id for w in self._waiting):
                self._waiting = [w for w in self._waiting if w.request_id != request_id]
            else:
                self.engine.abort_request([request_id])
            if not self._requests:
                self._idle()

    def _rebuild_for_waiting(self) -> None:
        """The batch drained: an engine LoRA-able at the rank the waiting adapters need, then
        the waiting requests into it."""
        waiting, self._waiting = self._waiting, []
        need = max(w.rank for w in waiting)
        if need > self.lora_rank:
            self.lora_rank = lora_rank([need])
            self._shutdown()
            self._loras.clear()
            self.engine = self._engine()
        for w in waiting:
            del self._requests[w.request_id]
            self._submit(w.request_id, w.prompt_ids, w.params, w.deadline, w.adapter)

    def steps(self, timeout: float) -> list[Step]:
        """One engine step (`timeout` is not waited: with requests there is always one to run)."""
        if not self._requests:
            return []
        try:
            waiting = {w.request_id for w in self._waiting}
            if waiting and waiting == set(self._requests):
                self._rebuild_for_waiting()
            with self._turns(most_urgent(r.deadline(r.generated) for r in self._requests.values())) as held:
                loads = [Step(rid, (), adapter_load=self._loads.pop(rid)) for rid in list(self._loads)]
                out = loads + [step for step in map(self._convert, self.engine.step()) if step is not None]
                for step in out:
                    if step.finish is not None:
                        self._requests.pop(step.request_id, None)
                post(held, (r.deadline(r.generated) for r in self._requests.values()))
        except Exception as e:  # vLLM failed: every request fails with it (the worker makes a new batch)
            self._error = f"{type(e).__name__}: {e}"
            failed = [Step(rid, (), None, f"the vLLM batch stopped: {self._error}") for rid in self._requests]
            self._requests.clear()
            return failed
        return out

    def close(self) -> None:
        self._requests.clear()
        self._waiting.clear()
        self._idle()
        self._shutdown()

    def _shutdown(self) -> None:
        shutdown = getattr(self.engine.engine_core, "shutdown", None)
        if shutdown is not None:
            shutdown()

    def _idle(self) -> None:
        if self.gate is not None:
            self.gate.idle(self.gate_slot)

    def _convert(self, output: Any) -> Step | None:
        request = self._requests.get(output.request_id)
        if request is None or not output.outputs:
            return None
        completion = output.outputs[0]
        tokens = list(completion.token_ids)
        finish = None
        if output.finished:
            reason = completion.finish_reason
            if reason == "stop" and tokens and tokens[-1] in self.ends and not request.params.ignore_eos:
                tokens.pop()  # the end of sequence ends it; it is not part of the text
            finish = FinishReason.LENGTH if reason == "length" else FinishReason.STOP
        request.generated += len(tokens)
        lps = completion.logprobs or ()
        top = request.params.logprobs
        picked = tuple((t, _logprob(t, lps[i], top) if i < len(lps) else None) for i, t in enumerate(tokens))
        return Step(output.request_id, picked, finish)


def _logprob(token: int, alternatives: dict[int, Any], top: int) -> TokenLogprob | None:
    """vLLM's logprobs of one position (token id → `Logprob` with its rank) as ours."""
    chosen = alternatives.get(token)
    if chosen is None:
        return None
    ranked = sorted(alternatives.items(), key=lambda item: item[1].rank or math.inf)
    return TokenLogprob(token, float(chosen.logprob), tuple((t, float(lp.logprob)) for t, lp in ranked[:top]))


@dataclass
class VllmBinding:
    """Binds models for the worker loop (`worker_loop.Binding`) on vLLM's engine. One tier."""

    gate: StepGate | None = None
    slot: int = -1
    max_batch: int = 16
    kv_tokens: int = 8192
    checkpoint: Path | None = None
    adapter_ranks: tuple[int, ...] = ()
    """Of the adapters the store keeps for the bound model (its engine is LoRA-able for them)."""
    wake_s: ClassVar[float | None] = None
    build_window: ClassVar[tuple[float, float]] = (math.inf, math.inf)

    def load_beside(self, load: Load) -> Loaded | None:
        if load.stage is not None or load.stages:
            raise ValueError("a vLLM worker serves no pipeline stages (the torch engine's)")
        load.torch_checkpoint()  # refused before the bound model goes
        return None

    def load(self, load: Load, threads: int) -> Bound:
        t0 = time.monotonic()
        self.checkpoint = load.torch_checkpoint()
        root = adapters_root(load.artifact)
        kept = [read_manifest(d) for d in sorted(root.iterdir())] if root.is_dir() else []
        self.adapter_ranks = tuple(a.rank for a in kept if a is not None)
        batch = self.reopen(threads)
        loaded = Loaded(loaded_from_cache=True, load_s=time.monotonic() - t0, threads=torch.get_num_threads())
        return Bound(loaded, batch, batch_decoder(batch.tokenizer))

    def reopen(self, threads: int) -> VllmBatch:
        if self.checkpoint is None:
            raise RuntimeError("no model loaded in this worker")
        return VllmBatch(self.checkpoint, self.max_batch, self.kv_tokens, self.gate, self.slot, self.adapter_ranks)

    def release(self) -> None:
        self.checkpoint = None

    def tier_up(self) -> TieredUp:
        return TieredUp(Tier.TORCH, 0.0, "" if self.checkpoint is not None else "no model loaded")

    def tiered(self) -> TieredUp | None:
        return None

    def drop_session(self, session: str) -> None:
        pass  # vLLM's prefix cache is its own; no session state outlives a request

    def close(self) -> None:
        pass

"""One model's continuous batch on vLLM's engine (`LLMEngine`, the v1 engine core in this
process): the worker's `Batch` (`batch_types.py`, driven by `worker_loop.py`), as the torch engine's `ContinuousBatcher` is.

vLLM schedules, pages the KV cache, samples (each request with its own seed), applies
penalties, logit bias and structured output, and returns each step's new tokens per request
(`RequestOutputKind.DELTA`). Every engine call is made on the batch's own thread: `add` and
`cancel` queue a command that the thread takes before its next step, so vLLM is never entered
from two threads. Each step passes the node's headroom gate (`step_gate.py`), posted with the
most urgent running request's next-token deadline.
"""

from __future__ import annotations

import json
import math
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from vllm import EngineArgs
from vllm import SamplingParams as VllmSamplingParams
from vllm.inputs import TokensPrompt
from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams
from vllm.v1.engine.llm_engine import LLMEngine

from services.engine.batch_types import Step, check_fits, drain, ends_of_sequence
from services.engine.step_gate import StepGate
from services.engine.vllm_engine.params import kv_cache_bytes, sampling_kwargs, structured_kwargs
from shared.messages import FinishReason, SamplingParams, TokenLogprob

_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}

KV_SLACK_TOKENS = 512
"""Cache beyond the tokens promised: vLLM counts it in whole blocks (up to 128 tokens each on a
CPU) and keeps one back, and refuses a longest request that would not fit."""


@dataclass
class _Request:
    params: SamplingParams
    deadline: Callable[[int], float]
    generated: int = 0


@dataclass(frozen=True)
class _Add:
    request_id: str
    prompt_ids: tuple[int, ...]
    params: VllmSamplingParams


@dataclass(frozen=True)
class _Abort:
    request_id: str


class VllmBatch:
    """`add` requests, read their `steps`, `cancel`, `close`; `tokenizer` is the model's."""

    def __init__(
        self,
        checkpoint: Path,
        max_batch: int,
        kv_tokens: int,
        gate: StepGate | None = None,
        gate_slot: int = -1,
    ) -> None:
        config = json.loads((checkpoint / "config.json").read_text())
        dtype = str(config.get("dtype") or config.get("torch_dtype") or "float32")
        self.max_len = min(kv_tokens, int(config.get("max_position_embeddings") or kv_tokens))
        args = EngineArgs(
            model=str(checkpoint),
            # The checkpoint's (registration's choice for the node: float32 on a CPU, bfloat16 on a
            # GPU); vLLM's "auto" would run a float32 checkpoint in bfloat16 on a CPU.
            dtype=dtype,
            max_model_len=self.max_len,
            max_num_seqs=max(1, max_batch),
            # The cache the node's setting asks for, not a share of the device's memory: the
            # node's reservation station accounts for what its instances hold.
            kv_cache_memory_bytes=kv_cache_bytes(config, kv_tokens + KV_SLACK_TOKENS, _DTYPE_BYTES.get(dtype, 2)),
            seed=0,
            disable_log_stats=True,
        )
        self.engine = LLMEngine.from_engine_args(args)
        self.tokenizer: Any = self.engine.get_tokenizer()
        self.ends = sorted(ends_of_sequence(self.tokenizer, config.get("eos_token_id")))
        self.gate = gate if gate is not None and gate_slot >= 0 else None
        self.gate_slot = gate_slot
        self.waited = 0.0
        """Seconds the batch's thread has waited for the gate, in all."""
        self.threads = 0
        self._requests: dict[str, _Request] = {}
        """Requests added and not ended (read by both threads; a dict's single operations are atomic)."""
        self._commands: queue.Queue[_Add | _Abort | None] = queue.Queue()
        self._out: queue.Queue[Step] = queue.Queue()
        self._error = ""
        self._thread = threading.Thread(target=self._run, daemon=True, name="vllm-batch")
        self._thread.start()

    @property
    def active(self) -> int:
        return len(self._requests)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def set_threads(self, threads: int) -> None:
        """The runtime threads its steps run on, from the next step."""
        self.threads = threads

    # vLLM's engine core allocates its cache and its GPU memory in a process of its own: what
    # the worker reports of them is 0 (on the host the node's true-up measures this process's
    # RSS alone; on a GPU it has no measure and keeps the reservation).
    kv_bytes = 0

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
        if not self.alive:
            raise RuntimeError(f"the vLLM batch has stopped: {self._error}")
        check_fits(len(prompt_ids), params.max_tokens, self.max_len)
        structured = StructuredOutputsParams(**structured_kwargs(params.guide)) if params.guide is not None else None
        vllm_params = VllmSamplingParams(
            **sampling_kwargs(params, self.ends),
            structured_outputs=structured,
            output_kind=RequestOutputKind.DELTA,
        )
        self._requests[request_id] = _Request(params, deadline)
        self._commands.put(_Add(request_id, tuple(prompt_ids), vllm_params))

    def cancel(self, request_id: str) -> None:
        if self._requests.pop(request_id, None) is not None:
            self._commands.put(_Abort(request_id))

    def steps(self, timeout: float) -> list[Step]:
        """Every request's progress since the last call, waiting up to `timeout` for the first."""
        out = drain(self._out, timeout, lambda rid: rid in self._requests)  # not the cancelled
        for rid, step in out.items():
            if step.finish is not None or step.error:
                self._requests.pop(rid, None)
        if not self.alive:
            for rid in list(self._requests):
                out[rid] = Step(rid, (), None, f"the vLLM batch stopped: {self._error}")
                self._requests.pop(rid, None)
        return list(out.values())

    def close(self) -> None:
        self._commands.put(None)
        self._thread.join(timeout=30)
        self._requests.clear()
        if self.gate is not None:
            self.gate.idle(self.gate_slot)
        shutdown = getattr(self.engine.engine_core, "shutdown", None)
        if shutdown is not None:
            shutdown()

    # The batch's thread.

    def _run(self) -> None:
        try:
            while True:
                busy = self.engine.has_unfinished_requests()
                if not self._take_commands(block=not busy):
                    return
                if self.engine.has_unfinished_requests():
                    self._step()
                elif self.gate is not None:
                    self.gate.idle(self.gate_slot)
        except Exception as e:  # vLLM failed: every running request fails with it (the worker makes a new batch)
            self._error = f"{type(e).__name__}: {e}"
            if self.gate is not None:
                self.gate.idle(self.gate_slot)

    def _take_commands(self, block: bool) -> bool:
        """Apply the queued commands (waiting for one when idle); False once closed."""
        try:
            command = self._commands.get() if block else self._commands.get_nowait()
        except queue.Empty:
            return True
        while command is not None:
            if isinstance(command, _Add):
                if command.request_id in self._requests:  # not cancelled while queued
                    try:
                        prompt = TokensPrompt(prompt_token_ids=list(command.prompt_ids))
                        self.engine.add_request(command.request_id, prompt, command.params)
                    except Exception as e:  # a spec vLLM refuses: that request fails alone
                        self._out.put(Step(command.request_id, (), None, f"{type(e).__name__}: {e}"))
            else:
                self.engine.abort_request([command.request_id])
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True
        return False

    def _step(self) -> None:
        if self.threads and torch.get_num_threads() != self.threads:
            torch.set_num_threads(self.threads)
        if self.gate is None:
            outputs = self.engine.step()
        else:
            with self.gate.turn(self.gate_slot, self._deadline()) as turn:
                self.waited += turn.waited
                outputs = self.engine.step()
                turn.then = self._deadline()
        for output in outputs:
            step = self._convert(output)
            if step is not None:
                self._out.put(step)

    def _deadline(self) -> float:
        going = [r.deadline(r.generated) for r in list(self._requests.values())]
        return min(going, default=math.inf)

    def _convert(self, output: Any) -> Step | None:
        request = self._requests.get(output.request_id)
        if request is None or not output.outputs:
            return None
        completion = output.outputs[0]
        tokens = list(completion.token_ids)
        logprobs = [
            _logprob(t, d, request.params.logprobs) for t, d in zip(tokens, completion.logprobs or (), strict=False)
        ]
        finish = None
        if output.finished:
            reason = completion.finish_reason
            if reason == "stop" and tokens and tokens[-1] in self.ends and not request.params.ignore_eos:
                tokens.pop()  # the end of sequence ends it; it is not part of the text
            finish = FinishReason.LENGTH if reason == "length" else FinishReason.STOP
        request.generated += len(tokens)
        picked: list[tuple[int, TokenLogprob | None]] = [
            (t, logprobs[i] if i < len(logprobs) else None) for i, t in enumerate(tokens)
        ]
        return Step(output.request_id, tuple(picked), finish)


def _logprob(token: int, alternatives: dict[int, Any], top: int) -> TokenLogprob | None:
    """vLLM's logprobs of one position (token id → `Logprob` with its rank) as ours."""
    chosen = alternatives.get(token)
    if chosen is None:
        return None
    ranked = sorted(alternatives.items(), key=lambda item: item[1].rank or math.inf)
    return TokenLogprob(token, float(chosen.logprob), tuple((t, float(lp.logprob)) for t, lp in ranked[:top]))

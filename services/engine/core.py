"""The continuous-batching core: OpenVINO GenAI's `ContinuousBatchingPipeline` as a `Batch`
(paged KV cache, chunked prefill by `dynamic_split_fuse`, prefix caching, the library's sampler),
as vLLM v1's `EngineCore` drives its own; and the request checks the OpenVINO batches share.
`step()` holds the GIL: only the worker's main thread calls the batch.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from policy.adapter_turns import BASE, joins_now, next_group
from services.engine.batch_types import AdapterLoad, Step
from services.engine.sampling import is_greedy
from services.engine.step_gate import TakeTurn, Turns, most_urgent, no_turn, post
from shared.adapters import ADAPTER_WEIGHTS
from shared.messages import AdapterRef, FinishReason, SamplingParams, TokenLogprob

if TYPE_CHECKING:  # imported by the worker at build time (its pre-warm already loaded it)
    import openvino_genai as ov_genai


def check_prompt(prompt_ids: Sequence[int], max_tokens: int, vocab_size: int, kv_tokens: int) -> None:
    """Refuse (that request alone) what no forward pass can take: an id outside the vocabulary
    would be embedded as garbage by the library, not refused."""
    if not prompt_ids:
        raise ValueError("the prompt has no tokens")
    if len(prompt_ids) + max_tokens > kv_tokens:
        raise ValueError(
            f"the prompt ({len(prompt_ids)} tokens) and max_tokens ({max_tokens}) exceed this instance's "
            f"KV cache of {kv_tokens} tokens"
        )
    bad = [t for t in prompt_ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"token id {bad[0]} is outside the model's vocabulary of {vocab_size}")


CORE_MAX_SEQS = 256
"""Requests the pipeline runs at once (the library's `max_num_seqs` default)."""
MAX_BATCHED_TOKENS = 256
"""Tokens one step computes: a long prompt is prefilled in chunks beside the decodes."""
FLOAT32_TINY = 1e-30


def generation_config(params: SamplingParams, eos_token_id: int) -> ov_genai.GenerationConfig:
    import openvino_genai as ov_genai

    config = ov_genai.GenerationConfig()
    config.max_new_tokens = params.max_tokens
    config.set_eos_token_id(eos_token_id)
    config.ignore_eos = params.ignore_eos
    # The library checks these > 0 as float32: a smaller positive double is raised to one it
    # keeps (the same choice: only the most likely token survives either).
    config.repetition_penalty = max(params.repetition_penalty, FLOAT32_TINY)
    config.frequency_penalty = params.frequency_penalty
    config.presence_penalty = params.presence_penalty
    config.do_sample = not is_greedy(params)  # decided once, in `sampling`, for every engine
    if config.do_sample:
        config.temperature = max(params.temperature, FLOAT32_TINY)
        config.top_p = max(params.top_p, FLOAT32_TINY)
        if params.top_k > 0:
            config.top_k = params.top_k
        config.min_p = params.min_p
        # Without a seed the library starts each request at one default: equal prompts alike.
        config.rng_seed = params.seed if params.seed is not None else random.getrandbits(32)
    if params.logprobs >= 0:
        config.logprobs = 1  # the library's: the chosen token's only (alternatives: `needs_logits`)
    if params.guide is not None:
        guide = ov_genai.StructuredOutputConfig()
        setattr(guide, params.guide.kind, params.guide.spec)
        config.structured_output_config = guide
    return config


def needs_core(params: SamplingParams) -> bool:
    """Whether the request waits for the core: the start tier has no grammar, a seed names a
    sample of the core's sampler, and the core's is the sampler for penalties, top-k, min-p."""
    return not needs_logits(params) and (
        params.guide is not None
        or params.seed is not None
        or params.frequency_penalty != 0.0
        or params.presence_penalty != 0.0
        or params.top_k > 0
        or params.min_p > 0.0
    )


def needs_logits(params: SamplingParams) -> bool:
    """Whether only the stateful tier serves it: logit_bias and top_logprobs need the logits,
    which the pipeline does not expose (the gateway refuses them with a grammar)."""
    return bool(params.logit_bias) or params.logprobs > 0


def build_pipeline(
    artifact_path: str, device: str, threads: int, adapters: Sequence[str] = ()
) -> ov_genai.ContinuousBatchingPipeline:
    """The pipeline on the artifact's IR, its KV cache the library's dynamic allocation: it grows
    as the admitted requests need (bounded by the memory manager's KV grant, §6.4) and reuses
    freed blocks; a fixed block count had to guess at build time. ≈ 2.4 s here, mostly the
    compile, which `CACHE_DIR` does not save: OpenVINO 2026.4 writes the paged-attention model's
    blob but cannot import it (`tests/integration/test_core_cache.py`, the library's canary):
    hence the start tier serves meanwhile.

    `adapters` (LoRA weight files, issue 34): built LoRA-able for them. The library makes a
    pipeline LoRA-able only when built with adapters, and only on the linears those adapters
    update (an adapter applied later on other linears has them silently ignored: "Unused LoRA
    tensor"), hence every adapter kept for the base. Without prefix caching: its blocks are
    keyed by tokens alone, and a prefix computed under one adapter is no prefix of another's."""
    import openvino_genai as ov_genai

    scheduler = ov_genai.SchedulerConfig()
    scheduler.cache_size = 0
    scheduler.num_kv_blocks = 0
    scheduler.enable_prefix_caching = not adapters
    scheduler.dynamic_split_fuse = True
    scheduler.max_num_batched_tokens = MAX_BATCHED_TOKENS
    properties: dict[str, Any] = {"INFERENCE_NUM_THREADS": threads} if device == "CPU" else {}
    if adapters:
        properties["adapters"] = ov_genai.AdapterConfig([ov_genai.Adapter(path) for path in adapters])
    tokenizer = ov_genai.Tokenizer(str(Path(artifact_path)))
    return ov_genai.ContinuousBatchingPipeline(str(Path(artifact_path)), tokenizer, scheduler, device, **properties)


def warm_up(pipeline: ov_genai.ContinuousBatchingPipeline, rows: int = 8) -> None:
    """A small crowd through a new core (TIDAL §5.1, proactive code loading with reduced
    inputs): the first 6 × 32-token crowd took 4.4 s on a fresh core, 1.7 s after this."""
    import openvino_genai as ov_genai

    config = ov_genai.GenerationConfig()
    config.max_new_tokens = 2
    config.ignore_eos = True
    # 20 to 60 tokens each, together past MAX_BATCHED_TOKENS: a crowd's first steps' shapes.
    prompts = [f"Warm-up {i}: " + "the sea and the ships on it " * (3 + i % 6) for i in range(rows)]
    pipeline.generate(prompts, [config] * rows)


_FINISH = {"LENGTH": FinishReason.LENGTH, "STOP": FinishReason.STOP}


@dataclass
class _Request:
    handle: Any
    prompt_ids: Sequence[int]
    params: SamplingParams
    deadline: Callable[[int], float]
    generated: int = 0


@dataclass(frozen=True)
class _Waiting:
    """A request whose adapter group waits for its turn (`policy.adapter_turns`)."""

    request_id: str
    prompt_ids: Sequence[int]
    params: SamplingParams
    deadline: Callable[[int], float]
    adapter: AdapterRef | None
    arrived: float


class CoreBatch:
    """The pipeline as a `Batch`: a `steps` call is at most one `pipeline.step()`, in a turn at
    the gate. `kv_tokens`: the most a request may hold (the model's context). The worker's
    batch (`TieredBatch`) takes the gate's posting down when nothing is left to run.

    A LoRA-able pipeline (`lora`, built with `build_pipeline`'s adapters) runs its requests by
    adapter group (`policy.adapter_turns`): the library's `step()` ignores a request's own
    `GenerationConfig.adapters` and applies the set its last `generate` applied (which it
    refuses while requests run), so requests of different adapters cannot share a step. Between
    groups the drained pipeline's `generate` of one token applies the next group's adapter
    (≈ 1 ms here); an adapter is read at its group's first turn and kept until `drop_adapter`."""

    def __init__(
        self,
        pipeline: Any,
        eos_token_id: int,
        vocab_size: int,
        kv_tokens: int,
        turn: TakeTurn = no_turn,
        lora: bool = False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._turns = Turns(turn)
        self.pipeline = pipeline
        self.eos_token_id = eos_token_id
        self.vocab_size = vocab_size
        self.kv_tokens = kv_tokens
        self._live: dict[str, _Request] = {}
        self._next_id = 0
        self._error = ""
        self.lora = lora
        self.clock = clock
        self._applied: str | None = None if lora else BASE
        """The adapter group the pipeline applies now (None: not known, the next turn applies)."""
        self._waiting: dict[str, list[_Waiting]] = {}
        self._adapters: dict[str, Any] = {}
        """Loaded adapters (`ov_genai.Adapter`) by name."""

    @property
    def active(self) -> int:
        return len(self._live) + sum(len(q) for q in self._waiting.values())

    @property
    def adapters(self) -> tuple[str, ...]:
        return tuple(sorted(self._adapters))

    @property
    def alive(self) -> bool:
        return not self._error  # a step failed: the pipeline may be broken

    @property
    def waited(self) -> float:
        return self._turns.waited

    @property
    def kv_bytes(self) -> int:
        return int(self.pipeline.get_metrics().kv_cache_size_in_bytes)

    def set_threads(self, threads: int) -> None:
        """Its threads are fixed when it is compiled."""

    def device_bytes(self) -> int:
        return 0  # nothing on a GPU

    def add(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        deadline: Callable[[int], float] = lambda _: math.inf,
        kv_tokens: int = 0,
        adapter: AdapterRef | None = None,
    ) -> None:
        if self._error:
            raise RuntimeError(f"the continuous-batching core has stopped: {self._error}")
        check_prompt(prompt_ids, params.max_tokens, self.vocab_size, self.kv_tokens)
        if adapter is not None and not self.lora:  # never the base's output for it
            raise ValueError(f"this pipeline was not built LoRA-able: `{adapter.name}` cannot be applied")
        group = adapter.name if adapter is not None else BASE
        if not joins_now(group, self._applied, self._waiting):
            generation_config(params, self.eos_token_id)  # a spec the library refuses raises now
            waiting = _Waiting(request_id, prompt_ids, params, deadline, adapter, self.clock())
            self._waiting.setdefault(group, []).append(waiting)
            return
        handle = self._submit(prompt_ids, params)  # a spec the library refuses raises here, alone
        self._live[request_id] = _Request(handle, prompt_ids, params, deadline)

    def drop_adapter(self, name: str) -> None:
        """Its keep-alive passed with none of its requests here: let it go (read again at its
        group's next turn)."""
        self._adapters.pop(name, None)
        if self._applied == name:
            self._applied = None

    def _submit(self, prompt_ids: Sequence[int], params: SamplingParams) -> Any:
        import numpy as np
        import openvino as ov

        ids = ov.Tensor(np.asarray([prompt_ids], dtype=np.int64))
        self._next_id += 1
        return self.pipeline.add_request(self._next_id, ids, generation_config(params, self.eos_token_id))

    def cancel(self, request_id: str) -> None:
        request = self._live.pop(request_id, None)
        if request is not None:
            request.handle.stop()
        for group, queue in list(self._waiting.items()):
            self._waiting[group] = [w for w in queue if w.request_id != request_id]
            if not self._waiting[group]:
                del self._waiting[group]

    def steps(self, timeout: float) -> list[Step]:
        """One step (`timeout` is not waited: with requests there is always a step to run); a
        drained pipeline with groups waiting first gives the next group its turn."""
        turn = self._next_turn() if not self._live and self._waiting else []
        if not self.pipeline.has_non_finished_requests():
            return turn + self._read_all()  # a stopped request's last words, if any
        return turn + self._step()

    def _next_turn(self) -> list[Step]:
        """The longest waiting group into the drained pipeline, its adapter applied (read
        first where not loaded: that request's step says so)."""
        if self.pipeline.has_non_finished_requests():
            self.pipeline.step()  # stopped requests not yet cleared: the library frees them here
            if self.pipeline.has_non_finished_requests():
                return []
        group = next_group({g: q[0].arrived for g, q in self._waiting.items()})
        queue = self._waiting.pop(group)
        try:
            load = self._apply(group, queue[0].adapter)
        except Exception as e:  # its file unreadable, or refused: its requests fail, others go on
            self._applied = None
            return [Step(w.request_id, (), None, f"the adapter `{group}` could not be applied: {e}") for w in queue]
        out = [Step(queue[0].request_id, (), adapter_load=load)] if load is not None else []
        for w in queue:
            try:
                handle = self._submit(w.prompt_ids, w.params)
            except Exception as e:  # that request alone
                out.append(Step(w.request_id, (), None, f"{type(e).__name__}: {e}"))
                continue
            self._live[w.request_id] = _Request(handle, w.prompt_ids, w.params, w.deadline)
        return out

    def _apply(self, group: str, ref: AdapterRef | None) -> AdapterLoad | None:
        """Apply `group`'s adapter (none for the base) by a one-token `generate`: the library's
        one way to set a continuous-batching pipeline's adapters."""
        import numpy as np
        import openvino as ov
        import openvino_genai as ov_genai

        t0 = time.perf_counter()
        fresh = ref is not None and group not in self._adapters
        if ref is not None and fresh:
            self._adapters[group] = ov_genai.Adapter(str(Path(ref.path) / ADAPTER_WEIGHTS))
        t1 = time.perf_counter()
        config = ov_genai.GenerationConfig()
        config.max_new_tokens = 1
        config.ignore_eos = True
        config.adapters = (
            ov_genai.AdapterConfig(self._adapters[group], ref.scale) if ref is not None else ov_genai.AdapterConfig()
        )
        self.pipeline.generate([ov.Tensor(np.asarray([[self.eos_token_id]], dtype=np.int64))], [config])
        self._applied = group
        return AdapterLoad(group, t1 - t0, time.perf_counter() - t1) if fresh else None

    def _step(self) -> list[Step]:
        try:
            with self._turns(most_urgent(r.deadline(r.generated) for r in self._live.values())) as held:
                self.pipeline.step()
                out = self._read_all()
                post(held, (r.deadline(r.generated) for r in self._live.values()))
        except Exception as e:  # every request on the core fails; the worker makes a new batch
            self._error = f"{type(e).__name__}: {e}"
            failed = [Step(rid, (), None, self._error) for rid in self._live]
            self._live.clear()
            return failed
        return out

    def _read_all(self) -> list[Step]:
        out = [self._read(rid, request, len(self._live)) for rid, request in list(self._live.items())]
        return [step for step in out if step is not None]

    def _read(self, request_id: str, request: _Request, running: int) -> Step | None:
        tokens: list[tuple[int, TokenLogprob | None]] = []
        finish: FinishReason | None = None
        if request.handle.can_read():
            for result in request.handle.read().values():
                lps = result.generated_log_probs if request.params.logprobs >= 0 else []
                tokens += [
                    (int(t), TokenLogprob(token=int(t), logprob=float(lps[i])) if i < len(lps) else None)
                    for i, t in enumerate(result.generated_ids)
                ]
                finish = _FINISH.get(result.finish_reason.name, finish)
        status = request.handle.get_status().name
        if finish is None and status == "IGNORED" and request.generated == 0 and not tokens:
            # The KV cache was full: with others running it waits for their blocks; alone, never.
            if running > 1:
                request.handle = self._submit(request.prompt_ids, request.params)
                return None
            del self._live[request_id]
            return Step(
                request_id, (), None, f"a prompt of {len(request.prompt_ids)} tokens does not fit in this KV cache"
            )
        if finish is None and status != "RUNNING":
            finish = FinishReason.STOP if status == "FINISHED" else FinishReason.CANCELLED
        if finish is not None and tokens and tokens[-1][0] == self.eos_token_id and not request.params.ignore_eos:
            tokens.pop()  # the end of sequence ends it; it is no token of the completion
            finish = FinishReason.STOP
        request.generated += len(tokens)
        if finish is None:
            return Step(request_id, tuple(tokens)) if tokens else None
        del self._live[request_id]
        return Step(request_id, tuple(tokens), finish)

    def close(self) -> None:
        for request in self._live.values():
            request.handle.stop()
        self._live.clear()
        self._waiting.clear()
        self._adapters.clear()

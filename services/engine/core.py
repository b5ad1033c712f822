"""The continuous-batching engine core: OpenVINO GenAI's `ContinuousBatchingPipeline` driven
the way a serving engine drives it.

Paged KV cache, requests that join and leave at every step, chunked prefill (the library's
`dynamic_split_fuse`, so a long prompt or a long generation never blocks short ones), prefix
caching, and the library's sampling, penalties, stop strings and end-of-sequence handling.
What is left here is the loop of a serving engine (vLLM v1's `EngineCore`, OpenVINO Model
Server's use of this same pipeline): add what arrived, `step()`, hand out what each handle has
ready, and abort what a client gave up on.

`step()` and `GenerationHandle.read()` hold the GIL and must not run beside another step, so
the core lives on its worker process's main thread (`worker_process.py`) and nothing else calls it.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from shared.messages import FinishReason, SamplingParams

if TYPE_CHECKING:  # imported by the worker at build time (its pre-warm already loaded it)
    import openvino_genai as ov_genai

CORE_MAX_SEQS = 256
"""Requests the pipeline runs at once (the library's `max_num_seqs` default)."""

MAX_BATCHED_TOKENS = 256
"""Tokens one step may compute (the library's default): a long prompt is prefilled in chunks
of this many alongside the running decodes, so that it never stalls them for long."""


SAMPLING_EPS = 1e-5
"""A temperature below this samples greedily (vLLM's `_SAMPLING_EPS`)."""

FLOAT32_TINY = 1e-30


def generation_config(params: SamplingParams, eos_token_id: int) -> ov_genai.GenerationConfig:
    """The library's config for one request's sampling parameters."""
    import openvino_genai as ov_genai

    config = ov_genai.GenerationConfig()
    config.max_new_tokens = params.max_tokens
    config.set_eos_token_id(eos_token_id)
    config.ignore_eos = params.ignore_eos
    config.stop_strings = set(s for s in params.stop if s)
    config.include_stop_str_in_output = False  # OpenAI: the stop string is not returned
    # The library keeps these as float32 and checks them > 0: a positive double below float32's
    # range would fail that check, so the smallest ones are raised to one it keeps (the same
    # choice either way: only the most likely token survives such a top_p).
    config.repetition_penalty = max(params.repetition_penalty, FLOAT32_TINY)
    config.frequency_penalty = params.frequency_penalty
    config.presence_penalty = params.presence_penalty
    if params.temperature >= SAMPLING_EPS:
        config.do_sample = True
        config.temperature = params.temperature
        config.top_p = max(params.top_p, FLOAT32_TINY)
        if params.top_k > 0:
            config.top_k = params.top_k
        config.min_p = params.min_p
        # Every request gets its own stream of random numbers: without a seed the library
        # would start each one at the same default seed, and equal prompts would sample alike.
        config.rng_seed = params.seed if params.seed is not None else random.getrandbits(32)
    else:
        config.do_sample = False
    if params.logprobs >= 0:
        config.logprobs = 1  # the library's: the chosen token's only (alternatives: worker.needs_logits)
    if params.guide is not None:
        guide = ov_genai.StructuredOutputConfig()
        setattr(guide, params.guide.kind, params.guide.spec)
        config.structured_output_config = guide
    return config


def needs_core(params: SamplingParams) -> bool:
    """Whether only the core serves this request: the start tier has no grammar (structured
    output), and a seed names one sample of the core's sampler; penalties, top-k and min-p
    are the library's sampler's (the start tier's copies serve only requests that need the
    logits). Such a request waits for the core."""
    if needs_logits(params):
        return False
    return (
        params.guide is not None
        or params.seed is not None
        or params.frequency_penalty != 0.0
        or params.presence_penalty != 0.0
        or params.top_k > 0
        or params.min_p > 0.0
    )


def needs_logits(params: SamplingParams) -> bool:
    """Whether only the stateful tier serves this request: logit_bias and top_logprobs need
    the logits, which the pipeline does not expose (vLLM reads both from the logits too).
    The gateway refuses them together with a grammar."""
    return bool(params.logit_bias) or params.logprobs > 0


def build_pipeline(artifact_path: str, device: str, threads: int) -> ov_genai.ContinuousBatchingPipeline:
    """The pipeline on the artifact's IR, its KV cache allocated as the requests in it need.

    The cache is the library's dynamic allocation (`num_kv_blocks = cache_size = 0`): it
    starts at what the first requests need and grows in 256-token steps as rows grow, so it
    holds what the requests the engine admitted use, and those are bounded by the memory
    manager's KV grant (`service._kv_admit`: a request waits, or is refused, until the grant
    covers it; one that outgrows it is evicted, §6.4). Freed blocks go back to the
    pipeline's pool (prefix-cached ones are reused, measured: 12 rounds of 32 distinct
    200-token prompts kept one size), not to the OS. A fixed block count instead had to guess
    a size at build time, before the grant for later requests was known.

    Measured here (OpenVINO GenAI 2026.4, SmolLM2-135M, 2 cores): ≈ 2.4 s, most of it the CPU
    plugin compiling the paged-attention model; `CACHE_DIR` does not help (the plugin writes a
    blob for such a model but never imports it back), which is why a start serves its first
    tokens on the materialized stateful tier while this builds (`worker_process.py`)."""
    import openvino_genai as ov_genai

    scheduler = ov_genai.SchedulerConfig()
    scheduler.cache_size = 0
    scheduler.num_kv_blocks = 0
    scheduler.enable_prefix_caching = True
    scheduler.dynamic_split_fuse = True
    scheduler.max_num_batched_tokens = MAX_BATCHED_TOKENS
    properties: dict[str, Any] = {"INFERENCE_NUM_THREADS": threads} if device == "CPU" else {}
    tokenizer = ov_genai.Tokenizer(str(Path(artifact_path)))
    return ov_genai.ContinuousBatchingPipeline(str(Path(artifact_path)), tokenizer, scheduler, device, **properties)


WARM_UP_ROWS = 8
"""Rows of the warm-up crowd a new core decodes before it serves (`warm_up`)."""


def warm_up(pipeline: ov_genai.ContinuousBatchingPipeline, rows: int = WARM_UP_ROWS) -> None:
    """Run a small crowd through a new core (TIDAL §5.1's proactive code loading with reduced
    inputs), as part of its build: the first batched prefill and decode of a fresh pipeline
    pay for the CPU plugin's kernels and the first KV blocks. Measured here (SmolLM2-135M,
    one thread): the first 6 × 32-token crowd took 4.4 s on a fresh core and 2.0 s after; with
    this warm-up (≈ 2.5 s, on the build's thread while the node is idle) the first took 1.7 s."""
    import openvino_genai as ov_genai

    config = ov_genai.GenerationConfig()
    config.max_new_tokens = 2
    config.ignore_eos = True
    # Prompts of 20 to 60 tokens, together past MAX_BATCHED_TOKENS: a full split-fuse prefill
    # step and then smaller ones, the shapes a crowd's first steps have.
    prompts = [f"Warm-up {i}: " + "the sea and the ships on it " * (3 + i % 6) for i in range(rows)]
    pipeline.generate(prompts, [config] * rows)


class TextSink(Protocol):
    """Where one request's new tokens go (detokenized with the others': `streams.CoreStreams`)."""

    def write(self, tokens: Sequence[int], logprobs: Sequence[float] = ()) -> None: ...

    def end(self) -> None: ...


@dataclass
class Output:
    """What the core has for one request after a step."""

    request_id: str
    finish_reason: FinishReason | None = None
    """Set once the request is done (its text has all been written to its sink)."""
    completion_tokens: int = 0
    first_token_at: float | None = None
    added_at: float = 0.0
    finished_at: float = 0.0
    prompt_tokens: int = 0
    peak_running: int = 1
    """Most requests the core was running at once while this one ran."""
    error: str = ""
    """Set when it could not run at all (its context does not fit in the KV cache)."""


@dataclass
class _Live:
    handle: Any
    sink: TextSink
    out: Output
    prompt_ids: Sequence[int]
    params: SamplingParams
    aborted: bool = False


_FINISH = {"LENGTH": FinishReason.LENGTH, "STOP": FinishReason.STOP}


@dataclass
class EngineCore:
    """One pipeline and the requests in it. `clock` is time.monotonic (CLOCK_MONOTONIC:
    comparable across the node's processes)."""

    pipeline: Any
    eos_token_id: int
    clock: Callable[[], float] = time.monotonic
    _live: dict[str, _Live] = field(default_factory=dict)
    _ids: dict[str, int] = field(default_factory=dict)
    _next_id: int = 0

    def __len__(self) -> int:
        return len(self._live)

    def add(self, request_id: str, prompt_ids: Sequence[int], params: SamplingParams, sink: TextSink) -> None:
        out = Output(request_id, added_at=self.clock(), prompt_tokens=len(prompt_ids), peak_running=len(self._live) + 1)
        self._live[request_id] = _Live(self._submit(prompt_ids, params), sink, out, prompt_ids, params)

    def _submit(self, prompt_ids: Sequence[int], params: SamplingParams) -> Any:
        import numpy as np
        import openvino as ov

        ids = ov.Tensor(np.asarray([prompt_ids], dtype=np.int64))
        self._next_id += 1
        return self.pipeline.add_request(self._next_id, ids, generation_config(params, self.eos_token_id))

    def abort(self, request_id: str) -> bool:
        """Stop a request: its blocks are freed at the next step, and it ends CANCELLED."""
        live = self._live.get(request_id)
        if live is None:
            return False
        if not live.aborted:
            live.aborted = True
            live.handle.stop()
        return True

    def has_work(self) -> bool:
        return bool(self._live)

    def generated(self, request_id: str) -> int:
        """Tokens a live request has generated so far (0 once it is gone)."""
        live = self._live.get(request_id)
        return live.out.completion_tokens if live is not None else 0

    def kv_allocated_bytes(self) -> int:
        """Bytes the pipeline's KV cache holds now (its dynamic allocation)."""
        return int(self.pipeline.get_metrics().kv_cache_size_in_bytes)

    def step(self) -> list[Output]:
        """One step of the pipeline; the outputs of the requests that finished in it (every
        running request's new text has gone to its sink)."""
        if self.pipeline.has_non_finished_requests():
            self.pipeline.step()
        now = self.clock()
        running = len(self._live)
        done: list[Output] = []
        for request_id, live in list(self._live.items()):
            out = live.out
            out.peak_running = max(out.peak_running, running)
            finish: FinishReason | None = None
            if live.handle.can_read():
                for result in live.handle.read().values():
                    tokens = list(result.generated_ids)
                    if tokens:
                        if out.first_token_at is None:
                            out.first_token_at = now
                        out.completion_tokens += len(tokens)
                        logprobs = list(result.generated_log_probs) if live.params.logprobs >= 0 else []
                        live.sink.write(tokens, logprobs)
                    finish = _FINISH.get(result.finish_reason.name, finish)
            status = live.handle.get_status().name
            if live.aborted and status != "RUNNING":
                finish = FinishReason.CANCELLED
            elif finish is None and status == "IGNORED" and out.completion_tokens == 0:
                # The step could schedule nothing: the KV cache was full. With others running
                # it waits for their blocks (submitted again); alone, it can never fit.
                if running > 1:
                    live.handle = self._submit(live.prompt_ids, live.params)
                    continue
                out.error = f"a prompt of {out.prompt_tokens} tokens does not fit in this instance's KV cache"
                finish = FinishReason.CANCELLED
            elif finish is None and status != "RUNNING":
                # Ended without a reason (the handle was stopped or dropped): over either way.
                finish = FinishReason.STOP if status == "FINISHED" else FinishReason.CANCELLED
            if finish is not None:
                live.sink.end()
                out.finish_reason = finish
                out.finished_at = now
                done.append(out)
                del self._live[request_id]
        return done

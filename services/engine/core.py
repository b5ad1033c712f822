"""The continuous-batching engine core: OpenVINO GenAI's `ContinuousBatchingPipeline` as one
of the worker's `Batch`es (`batch_types.py`), and what the OpenVINO batches share.

Paged KV cache, requests that join and leave at every step, chunked prefill (the library's
`dynamic_split_fuse`, so a long prompt or a long generation never blocks short ones), prefix
caching, and the library's sampling, penalties, end-of-sequence and max_tokens handling. What
is left here is what a serving engine does around it (vLLM v1's `EngineCore`, OpenVINO Model
Server's use of this same pipeline): add what arrived, `step()`, hand out each request's new
token ids, and stop what a client gave up on. Text and stop strings are the worker loop's
(one detokenizer and one stop matcher for every backend), so the library gets no stop strings.

`step()` and `GenerationHandle.read()` hold the GIL and must not run beside another step, so
the batch is stepped on its worker process's main thread and nothing else calls it.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from services.engine.batch_types import Step
from services.engine.sampling import is_greedy
from services.engine.step_gate import TakeTurn, Turns, most_urgent, no_turn, post
from shared.messages import FinishReason, SamplingParams, TokenLogprob

if TYPE_CHECKING:  # imported by the worker at build time (its pre-warm already loaded it)
    import openvino_genai as ov_genai


def check_prompt(prompt_ids: Sequence[int], max_tokens: int, vocab_size: int, kv_tokens: int) -> None:
    """Refuse (ValueError, that request alone) a request no forward pass can take: an empty
    prompt, an id outside the vocabulary (the library would embed it as garbage, not fail), or
    more tokens than the KV cache holds (the gateway bounds requests by the model's context)."""
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
"""Tokens one step may compute (the library's default): a long prompt is prefilled in chunks
of this many alongside the running decodes, so that it never stalls them for long."""


FLOAT32_TINY = 1e-30


def generation_config(params: SamplingParams, eos_token_id: int) -> ov_genai.GenerationConfig:
    """The library's config for one request's sampling parameters."""
    import openvino_genai as ov_genai

    config = ov_genai.GenerationConfig()
    config.max_new_tokens = params.max_tokens
    config.set_eos_token_id(eos_token_id)
    config.ignore_eos = params.ignore_eos
    # The library keeps these as float32 and checks them > 0: a positive double below float32's
    # range would fail that check, so the smallest ones are raised to one it keeps (the same
    # choice either way: only the most likely token survives such a temperature or top_p).
    config.repetition_penalty = max(params.repetition_penalty, FLOAT32_TINY)
    config.frequency_penalty = params.frequency_penalty
    config.presence_penalty = params.presence_penalty
    if not is_greedy(params):  # decided once, in `sampling`, for every engine
        config.do_sample = True
        config.temperature = max(params.temperature, FLOAT32_TINY)
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
        config.logprobs = 1  # the library's: the chosen token's only (alternatives: `needs_logits`)
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
    tokens on the materialized stateful tier while this builds (`tiered_batch.py`)."""
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


_FINISH = {"LENGTH": FinishReason.LENGTH, "STOP": FinishReason.STOP}


@dataclass
class _Request:
    handle: Any
    prompt_ids: Sequence[int]
    params: SamplingParams
    deadline: Callable[[int], float]
    generated: int = 0


class CoreBatch:
    """The pipeline as a `Batch`: each `steps` call runs at most one `pipeline.step()` (inside
    a turn of `turn`, with the most urgent request's deadline) and returns every request's
    new token ids, and how those that ended ended. A cancelled request is stopped in the
    library (its blocks are freed at the next step) and never heard of again. `kv_tokens`: the
    most a request may hold (the model's context); `idle`: called when the batch has nothing
    left to run but not from a step (a cancel, a close), to take its posting at the gate down."""

    def __init__(
        self,
        pipeline: Any,
        eos_token_id: int,
        vocab_size: int,
        kv_tokens: int,
        turn: TakeTurn = no_turn,
        idle: Callable[[], None] = lambda: None,
    ) -> None:
        self.pipeline = pipeline
        self.eos_token_id = eos_token_id
        self.vocab_size = vocab_size
        self.kv_tokens = kv_tokens
        self._turns = Turns(turn)
        self._idle = idle
        self._live: dict[str, _Request] = {}
        self._next_id = 0
        self._error = ""

    @property
    def active(self) -> int:
        return len(self._live)

    @property
    def waited(self) -> float:
        return self._turns.waited

    @property
    def alive(self) -> bool:
        """False once a step failed (every request on it failed; the pipeline may be broken)."""
        return not self._error

    def set_threads(self, threads: int) -> None:
        """The pipeline's threads are fixed when it is built (`build_pipeline`)."""

    @property
    def kv_bytes(self) -> int:
        """Bytes the pipeline's KV cache holds now (its dynamic allocation)."""
        return int(self.pipeline.get_metrics().kv_cache_size_in_bytes)

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
        if self._error:
            raise RuntimeError(f"the continuous-batching core has stopped: {self._error}")
        check_prompt(prompt_ids, params.max_tokens, self.vocab_size, self.kv_tokens)
        handle = self._submit(prompt_ids, params)  # a spec the library refuses raises here, alone
        self._live[request_id] = _Request(handle, prompt_ids, params, deadline)

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
            if not self._live:
                self._idle()

    def steps(self, timeout: float) -> list[Step]:
        """One step of the pipeline and the new tokens and ends it made (`timeout` is not
        waited: with requests there is always a step to run, and without none)."""
        if not self.pipeline.has_non_finished_requests():
            return self._read_all()  # a stopped request's last words, if any
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
                ids = [int(t) for t in result.generated_ids]
                logprobs = [float(lp) for lp in result.generated_log_probs] if request.params.logprobs >= 0 else []
                tokens += [
                    (t, TokenLogprob(token=t, logprob=logprobs[i]) if i < len(logprobs) else None)
                    for i, t in enumerate(ids)
                ]
                finish = _FINISH.get(result.finish_reason.name, finish)
        status = request.handle.get_status().name
        if finish is None and status == "IGNORED" and request.generated == 0 and not tokens:
            # The step could schedule nothing: the KV cache was full. With others running it
            # waits for their blocks (submitted again); alone, it can never fit.
            if running > 1:
                request.handle = self._submit(request.prompt_ids, request.params)
                return None
            del self._live[request_id]
            return Step(
                request_id, (), None, f"a prompt of {len(request.prompt_ids)} tokens does not fit in this KV cache"
            )
        if finish is None and status != "RUNNING":
            # Ended without a reason (the handle was stopped or dropped): over either way.
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
        self._idle()

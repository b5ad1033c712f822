"""One model instance on OpenVINO: load it, generate with it (in a worker thread).

`generate` runs on a thread of its own (OpenVINO releases the GIL while it computes) and
reports each piece of text through `emit`; the asyncio side turns those into bus messages.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import openvino_genai as ov_genai

from services.engine.stops import StopMatcher
from shared.messages import Artifact, FinishReason, SamplingParams

Emit = Callable[[str, int], None]
"""emit(text, tokens): text to send and the tokens decoded since the last call."""


class _Streamer(ov_genai.StreamerBase):  # type: ignore[misc]
    """Counts tokens, detokenizes incrementally, applies stop strings, honours cancellation."""

    def __init__(
        self,
        tokenizer: ov_genai.Tokenizer,
        stops: StopMatcher,
        emit: Emit,
        cancelled: threading.Event,
    ) -> None:
        super().__init__()
        self.tokens = 0
        self._pending_tokens = 0
        self._stops = stops
        self._emit = emit
        self._cancelled = cancelled
        self._ended = False
        self._text = ov_genai.TextStreamer(tokenizer, self._on_text)

    def _on_text(self, piece: str) -> ov_genai.StreamingStatus:
        out = self._stops.feed(piece)
        if out:
            self._emit(out, self._pending_tokens)
            self._pending_tokens = 0
        return ov_genai.StreamingStatus.RUNNING

    def write(self, token: int | list[int]) -> ov_genai.StreamingStatus:
        n = len(token) if isinstance(token, list) else 1
        self.tokens += n
        self._pending_tokens += n
        self._text.write(token)
        if self._stops.stopped or self._cancelled.is_set():
            return ov_genai.StreamingStatus.CANCEL
        return ov_genai.StreamingStatus.RUNNING

    def end(self) -> None:
        # The pipeline may call end() more than once; flush exactly once.
        if self._ended:
            return
        self._ended = True
        self._text.end()
        rest = self._stops.flush()
        if rest or self._pending_tokens:
            self._emit(rest, self._pending_tokens)
            self._pending_tokens = 0


@dataclass
class GenerationResult:
    finish_reason: FinishReason
    completion_tokens: int
    first_token_at: float | None


@dataclass
class Instance:
    model: str
    artifact: Artifact
    pipe: ov_genai.LLMPipeline
    loaded_at: float
    last_used: float
    active: int = 0
    first_token_at: float | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    @classmethod
    def load(cls, model: str, artifact: Artifact, device: str, threads: int) -> Instance:
        props: dict[str, object] = {}
        if device == "CPU":
            props["INFERENCE_NUM_THREADS"] = threads
        pipe = ov_genai.LLMPipeline(artifact.path, device, **props)
        now = time.time()
        return cls(model=model, artifact=artifact, pipe=pipe, loaded_at=now, last_used=now)

    def generate(self, prompt: str, params: SamplingParams, emit: Emit, cancelled: threading.Event) -> GenerationResult:
        cfg = self.pipe.get_generation_config()
        # The gateway already rendered the chat template (or sent a raw completion prompt).
        cfg.apply_chat_template = False
        cfg.max_new_tokens = params.max_tokens
        cfg.ignore_eos = params.ignore_eos
        if params.temperature <= 0.0:
            cfg.do_sample = False
        else:
            cfg.do_sample = True
            cfg.temperature = params.temperature
            cfg.top_p = params.top_p
            # OpenVINO's default seed is fixed; without a seed a caller expects fresh samples.
            cfg.rng_seed = params.seed if params.seed is not None else random.getrandbits(31)
        stops = StopMatcher(params.stop)
        first: list[float] = []

        def timed_emit(text: str, tokens: int) -> None:
            if not first:
                first.append(time.perf_counter())
            emit(text, tokens)

        streamer = _Streamer(self.pipe.get_tokenizer(), stops, timed_emit, cancelled)
        with self.lock:  # one generation at a time on an LLMPipeline
            self.pipe.generate([prompt], cfg, streamer)
            streamer.end()
        if cancelled.is_set() and not stops.stopped:
            reason = FinishReason.CANCELLED
        elif stops.stopped or streamer.tokens < params.max_tokens:
            reason = FinishReason.STOP
        else:
            reason = FinishReason.LENGTH
        return GenerationResult(reason, streamer.tokens, first[0] if first else None)

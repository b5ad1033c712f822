"""One model instance on OpenVINO: restore it from its materialized state, generate with it.

The model is a stateful OpenVINO IR (the KV cache lives in the infer request's state). It is
compiled once, at registration, with `CACHE_DIR` pointing into the artifact (MEDUSA §2.5, §6:
do offline what every start would otherwise derive); a start imports that blob, which
OpenVINO reports as `LOADED_FROM_CACHE`. The detokenizer loads on a second thread meanwhile.
Generation is a plain loop over the infer request, run in a worker process (`worker.py`),
reporting each piece of text through `emit`.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np
import openvino as ov

from services.engine.layout import compiled_cache_dir, model_xml
from services.engine.sampling import Sampler
from services.engine.stops import StopMatcher
from shared.messages import Artifact, FinishReason, SamplingParams, Tier


class Flag(Protocol):
    """Anything that says whether the generation should stop (checked after every token)."""

    def is_set(self) -> bool: ...


Emit = Callable[[str, int], None]
"""emit(text, tokens): text to send and the tokens decoded since the last call."""

def compile_config(
    artifact: Artifact, device: str, threads: int, cache_dir: str | None = None, tier: Tier = Tier.STEADY
) -> dict[str, object]:
    """`cache_dir`: where the compiled blob is (the loader's host cache); the store's copy
    when None."""
    config: dict[str, object] = {"CACHE_DIR": cache_dir or str(compiled_cache_dir(artifact, device, tier))}
    if device == "CPU":
        config["INFERENCE_NUM_THREADS"] = threads
    return config


def first_pass(compiled: ov.CompiledModel) -> None:
    """One token through a throwaway infer request: the CPU plugin repacks the weights on a
    model's first forward pass, so after this the next pass runs at full speed."""
    compiled.create_infer_request().infer({
        "input_ids": np.ones((1, 1), dtype=np.int64),
        "attention_mask": np.ones((1, 1), dtype=np.int64),
        "position_ids": np.zeros((1, 1), dtype=np.int64),
        "beam_idx": np.zeros(1, dtype=np.int32),
    })


DETOKENIZER_XML = "openvino_detokenizer.xml"


@functools.cache
def _tokenizer_core() -> ov.Core:
    """A Core with the string operations: importing openvino_tokenizers adds them to every
    Core created after the import (a Core made earlier lacks them)."""
    import openvino_tokenizers  # noqa: F401

    return ov.Core()


class Detokenizer:
    """The artifact's compiled detokenizer alone: token ids in, text out.

    The worker never encodes (the gateway sends token ids), so it skips the encoder and
    `openvino_genai.Tokenizer`'s own set-up: measured ≈ 0.05 s to load against 0.18 s, on the
    cores the model's import needs at the same moment. Same text: `skip_special_tokens` is
    baked into the compiled detokenizer, as `Tokenizer.decode` uses it.
    """

    def __init__(self, artifact_path: str) -> None:
        core = _tokenizer_core()
        model = core.read_model(str(Path(artifact_path) / DETOKENIZER_XML))
        rt = model.get_rt_info()
        if "eos_token_id" not in rt:
            raise RuntimeError(f"{DETOKENIZER_XML} in {artifact_path} names no eos_token_id")
        self.eos_token_id = int(rt["eos_token_id"].astype(int))
        self._request = core.compile_model(model, "CPU", {"INFERENCE_NUM_THREADS": 1}).create_infer_request()
        self.decode([self.eos_token_id])  # its first call pays a warm-up: not on the first token

    def decode(self, ids: Sequence[int]) -> str:
        if not ids:
            return ""
        out = self._request.infer({0: np.asarray([ids], dtype=np.int64)})
        return str(out[0][0])


class IncrementalDetokenizer:
    """Text of each new token as soon as it is whole (vLLM's incremental detokenization).

    Decodes a short window of recent tokens twice, with and without the newest, and emits the
    difference once it no longer ends in an incomplete UTF-8 sequence. OpenVINO GenAI's
    TextStreamer instead holds the first text back for three tokens, which cost ≈ 45 ms of
    TTFT here (measured: first text at 90 ms for a 45 ms prefill).
    """

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self._decode = decode
        self._ids: list[int] = []
        self._prefix = 0  # window start: text before it is final
        self._read = 0  # tokens whose text has been emitted

    def add(self, *tokens: int) -> str:
        self._ids.extend(tokens)
        before = self._decode(self._ids[self._prefix : self._read])
        after = self._decode(self._ids[self._prefix :])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self._ids)
            return after[len(before) :]
        return ""

    def flush(self) -> str:
        """Whatever is still held at the end (an incomplete sequence, as decoded)."""
        if self._read == len(self._ids):
            return ""
        before = self._decode(self._ids[self._prefix : self._read])
        after = self._decode(self._ids[self._prefix :])
        self._read = len(self._ids)
        return after[len(before) :]


class _Text:
    """Detokenized text through stop strings, counting the tokens behind each piece."""

    def __init__(self, tokenizer: Detokenizer, stops: StopMatcher, emit: Emit) -> None:
        self._stops = stops
        self._emit = emit
        self._pending = 0
        self._detok = IncrementalDetokenizer(tokenizer.decode)

    def _out(self, piece: str) -> None:
        out = self._stops.feed(piece) if piece else ""
        if out:
            self._emit(out, self._pending)
            self._pending = 0

    def write(self, tokens: Sequence[int]) -> None:
        self._pending += len(tokens)
        self._out(self._detok.add(*tokens))

    def end(self) -> None:
        self._out(self._detok.flush())
        rest = self._stops.flush()
        if rest or self._pending:
            self._emit(rest, self._pending)
            self._pending = 0


class _Coalesce:
    """Send text at most every `interval` seconds (the first piece at once).

    Each message wakes the engine's event loop, the gateway and the client; on a node whose
    cores all run inference threads, every wake-up stalls a decode step. Batching pieces that
    arrive within one interval keeps TTFT and cuts those wake-ups (vLLM's `stream_interval`).
    """

    def __init__(self, emit: Emit, interval_s: float) -> None:
        self._emit = emit
        self._interval = interval_s
        self._texts: list[str] = []
        self._tokens = 0
        self._last: float | None = None

    def __call__(self, text: str, tokens: int) -> None:
        self._texts.append(text)
        self._tokens += tokens
        now = time.perf_counter()
        if self._last is None or now - self._last >= self._interval:
            self.flush(now)

    def flush(self, now: float | None = None) -> None:
        if self._texts or self._tokens:
            self._emit("".join(self._texts), self._tokens)
            self._texts.clear()
            self._tokens = 0
            self._last = time.perf_counter() if now is None else now


@dataclass
class GenerationResult:
    finish_reason: FinishReason
    completion_tokens: int
    first_token_at: float | None


@dataclass
class LoadedModel:
    """A compiled model and its tokenizer: the part of an instance that can stay resident
    after the instance is gone, and that every name on the same artifact can share."""

    artifact: Artifact
    compiled: ov.CompiledModel
    tokenizer: Detokenizer
    eos_ids: frozenset[int]
    loaded_from_cache: bool
    tier: Tier = Tier.STEADY

    @classmethod
    def load(
        cls,
        core: ov.Core,
        artifact: Artifact,
        device: str,
        threads: int,
        cache_dir: str | None = None,
        tier: Tier = Tier.STEADY,
        tokenizer: Detokenizer | None = None,
    ) -> LoadedModel:
        """Import the tier's compiled blob (and load the tokenizer meanwhile, unless given)."""
        xml = str(model_xml(artifact, tier))
        config = compile_config(artifact, device, threads, cache_dir, tier)
        if tokenizer is None:
            with ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenizer") as side:
                pending = side.submit(Detokenizer, artifact.path)
                compiled = core.compile_model(xml, device, config)
                tokenizer = pending.result()
        else:
            compiled = core.compile_model(xml, device, config)
        return cls(
            artifact=artifact,
            compiled=compiled,
            tokenizer=tokenizer,
            eos_ids=frozenset({tokenizer.eos_token_id}),
            loaded_from_cache=bool(compiled.get_property("LOADED_FROM_CACHE")),
            tier=tier,
        )


@dataclass
class Instance:
    """A model name serving requests: a loaded model plus its own KV cache (infer request)."""

    model: str
    loaded: LoadedModel
    loaded_at: float
    last_used: float
    active: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)
    _request: ov.InferRequest | None = None

    @property
    def artifact(self) -> Artifact:
        return self.loaded.artifact

    @property
    def loaded_from_cache(self) -> bool:
        return self.loaded.loaded_from_cache

    @property
    def request(self) -> ov.InferRequest:
        # The infer request holds the KV cache: it exists only while the instance serves.
        if self._request is None:
            self._request = self.loaded.compiled.create_infer_request()
        return self._request

    def release_kv(self) -> None:
        self._request = None

    def _forward(self, ids: Sequence[int], past: int) -> np.ndarray:
        n = len(ids)
        req = self.request
        req.infer({
            "input_ids": np.asarray(ids, dtype=np.int64)[None, :],
            "attention_mask": np.ones((1, past + n), dtype=np.int64),
            "position_ids": np.arange(past, past + n, dtype=np.int64)[None, :],
            "beam_idx": np.zeros(1, dtype=np.int32),
        })
        logits: np.ndarray = req.get_tensor("logits").data[0, -1]
        return logits

    def generate(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        emit: Emit,
        cancelled: Flag,
        stream_interval_s: float = 0.0,
    ) -> GenerationResult:
        sampler = Sampler(params.temperature, params.top_p, params.seed)
        stops = StopMatcher(params.stop)
        first: list[float] = []

        def timed_emit(text: str, tokens: int) -> None:
            if not first:
                first.append(time.perf_counter())
            emit(text, tokens)

        out = _Coalesce(timed_emit, stream_interval_s)
        text = _Text(self.loaded.tokenizer, stops, out)
        # Detokenizing costs two detokenizer runs; without stop strings to watch, it is done
        # once per stream interval for the tokens since, not once per token (measured ≈ 8 % of
        # decode time per token otherwise). With stop strings, every token is checked at once
        # so that generation ends exactly at the stop.
        batch_s = 0.0 if params.stop else stream_interval_s
        held: list[int] = []
        last_text: float | None = None
        produced = 0
        reason = FinishReason.LENGTH
        with self.lock:  # one sequence at a time on this infer request
            self.request.reset_state()
            logits = self._forward(prompt_ids, 0)
            past = len(prompt_ids)
            while produced < params.max_tokens:
                token = sampler.pick(logits)
                if token in self.loaded.eos_ids and not params.ignore_eos:
                    reason = FinishReason.STOP
                    break
                produced += 1
                held.append(token)
                now = time.perf_counter()
                if last_text is None or now - last_text >= batch_s:
                    text.write(held)
                    held.clear()
                    last_text = now
                if stops.stopped:
                    reason = FinishReason.STOP
                    break
                if cancelled.is_set():
                    reason = FinishReason.CANCELLED
                    break
                if produced == params.max_tokens:
                    break
                logits = self._forward((token,), past)
                past += 1
            text.write(held)
            text.end()
            out.flush()
        return GenerationResult(reason, produced, first[0] if first else None)

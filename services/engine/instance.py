"""One model instance on OpenVINO: restore it from its materialized state, generate with it.

The model is a stateful OpenVINO IR (the KV cache lives in the infer request's state). It is
compiled once, at registration, with `CACHE_DIR` pointing into the artifact (MEDUSA §2.5, §6:
do offline what every start would otherwise derive); a start imports that blob, which
OpenVINO reports as `LOADED_FROM_CACHE`. The detokenizer loads on a second thread meanwhile.
Generation is a plain loop over the infer request, run in a worker process (`worker_process.py`),
reporting each piece of text through `emit`.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import openvino as ov

from services.engine import text_stream
from services.engine.batch import BatchItem, Join, RowEmit, RowResult, generate_batch
from services.engine.stops import StopMatcher
from shared.artifact import compile_config, model_xml
from shared.messages import Artifact, Tier

Emit = Callable[[str, int], None]
"""emit(text, tokens): text to send and the tokens decoded since the last call."""

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

    def decode_many(self, seqs: Sequence[Sequence[int]]) -> list[str]:
        """Each sequence's text, in one detokenizer run per distinct length (rows of a run
        must be equally long; padding would need a token the detokenizer is sure to skip).
        A run costs ≈ 0.2 ms here whether it holds one row or 32: decoding a crowd's pieces
        one by one took a fifth of the core's loop at 32 streams."""
        texts = [""] * len(seqs)
        by_length: dict[int, list[int]] = {}
        for i, ids in enumerate(seqs):
            if ids:
                by_length.setdefault(len(ids), []).append(i)
        for rows in by_length.values():
            out = self._request.infer({0: np.asarray([seqs[i] for i in rows], dtype=np.int64)})
            for i, text in zip(rows, out[0], strict=True):
                texts[i] = str(text)
        return texts


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


class TextStream:
    """A row's text (`text_stream.TextStream`: detokenized, through its stop strings,
    coalesced per stream interval), each piece handed to `emit` as it is due."""

    def __init__(self, tokenizer: Detokenizer, stops: StopMatcher, emit: Emit, interval_s: float) -> None:
        self._stream = text_stream.TextStream(tokenizer.decode, stops, interval_s, time.perf_counter)
        self._emit = emit

    def write(self, tokens: Sequence[int]) -> None:
        for token in tokens:
            if (piece := self._stream.add(int(token))) is not None:
                self._emit(piece.text, piece.tokens)

    def end(self) -> None:
        if (piece := self._stream.end()) is not None:
            self._emit(piece.text, piece.tokens)


@dataclass
class Batcher:
    """Generation on one loaded model for every name served from it: one infer request (its
    state is the KV cache of the batch running; no KV cache outlives a generation), created
    on the first request and released when no name is left."""

    loaded: LoadedModel
    names: set[str] = field(default_factory=set)
    _request: ov.InferRequest | None = None
    _rows: int = 0

    def drop(self, name: str) -> bool:
        """Forget `name`; True when that released the infer request (and its memory)."""
        self.names.discard(name)
        if not self.names and self._request is not None:
            self._request = None
            self._rows = 0
            return True
        return False

    def _request_for(self, rows: int) -> ov.InferRequest:
        if self._request is None or rows > self._rows:
            # A batch wider than any this request has run needs a new one: after
            # `reset_state`, OpenVINO 2026.4's CPU plugin kept the rows beyond the old width
            # wrong once the cache grew (measured: those rows' text diverged after ≈ 7 tokens).
            self._request = self.loaded.compiled.create_infer_request()
            self._rows = rows
        return self._request

    def generate(
        self,
        items: Sequence[BatchItem],
        emit: RowEmit,
        is_cancelled: Callable[[str], bool],
        stream_interval_s: float = 0.0,
        between_steps: Callable[[], None] | None = None,
        join: Join | None = None,
        wrap: Callable[[ov.InferRequest], Any] | None = None,
    ) -> list[RowResult]:
        """`wrap`: what every iteration's infer request is seen through (the node's gate)."""
        tokenizer = self.loaded.tokenizer

        def text(row_emit: Callable[[str, str, int], None], request_id: str, stops: StopMatcher) -> TextStream:
            return TextStream(tokenizer, stops, lambda t, n: row_emit(request_id, t, n), stream_interval_s)

        request_for = self._request_for if wrap is None else (lambda rows: wrap(self._request_for(rows)))
        return generate_batch(
            request_for, items, self.loaded.eos_ids, text, emit, is_cancelled, stream_interval_s, between_steps, join
        )

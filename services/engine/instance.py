"""A stateful OpenVINO IR restored from its materialized state: compiled once, at
registration, with `CACHE_DIR` in the artifact (MEDUSA §2.5, §6: do offline what every start
would otherwise derive); a start imports the blob while the detokenizer loads beside it.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import openvino as ov

from shared.artifact import compile_config, model_xml
from shared.messages import Artifact, Tier

DETOKENIZER_XML = "openvino_detokenizer.xml"


@functools.cache
def _tokenizer_core() -> ov.Core:
    """A Core with the string operations (only a Core made after the import has them)."""
    import openvino_tokenizers  # noqa: F401

    return ov.Core()


class Detokenizer:
    """The artifact's compiled detokenizer alone (the gateway sends token ids): ≈ 0.05 s to
    load against `openvino_genai.Tokenizer`'s 0.18 s, on the cores the model's import needs.
    Same text: `skip_special_tokens` is baked in, as `Tokenizer.decode` uses it."""

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
        return self.decode_many([ids])[0]

    def decode_many(self, seqs: Sequence[Sequence[int]]) -> list[str]:
        """One detokenizer run per distinct length (padding would need a token it is sure to
        skip): a run costs ≈ 0.2 ms whether it holds one row or 32."""
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
    artifact: Artifact
    compiled: ov.CompiledModel
    tokenizer: Detokenizer
    eos_ids: frozenset[int]
    loaded_from_cache: bool

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
        xml = str(model_xml(artifact, tier))
        config = compile_config(artifact, device, threads, cache_dir, tier)
        if tokenizer is None:
            with ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenizer") as side:
                pending = side.submit(Detokenizer, artifact.path)
                compiled = core.compile_model(xml, device, config)
                tokenizer = pending.result()
        else:
            compiled = core.compile_model(xml, device, config)
        eos = frozenset({tokenizer.eos_token_id})
        return cls(artifact, compiled, tokenizer, eos, bool(compiled.get_property("LOADED_FROM_CACHE")))

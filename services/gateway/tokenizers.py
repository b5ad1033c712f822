"""Tokenizers of registered models, loaded once per artifact from the model store.

The gateway counts prompt tokens and renders chat templates itself, so that a request that
cannot fit is refused before it costs a placement or a cold start.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import openvino_genai as ov_genai

from shared.messages import Artifact


class Tokenizers:
    def __init__(self) -> None:
        self._loaded: dict[str, ov_genai.Tokenizer] = {}
        self._lock = asyncio.Lock()

    async def get(self, artifact: Artifact) -> ov_genai.Tokenizer:
        tok = self._loaded.get(artifact.artifact_id)
        if tok is None:
            async with self._lock:
                tok = self._loaded.get(artifact.artifact_id)
                if tok is None:
                    tok = await asyncio.to_thread(ov_genai.Tokenizer, artifact.path)
                    self._loaded[artifact.artifact_id] = tok
        return tok

    @staticmethod
    def render_chat(tok: ov_genai.Tokenizer, messages: Sequence[dict[str, str]]) -> str:
        return str(tok.apply_chat_template(list(messages), add_generation_prompt=True))

    @staticmethod
    def encode(tok: ov_genai.Tokenizer, text: str) -> tuple[int, ...]:
        return tuple(int(i) for i in tok.encode(text).input_ids.data[0])

"""Tokenizers of registered models, loaded once per artifact from the model store.

The gateway counts prompt tokens and renders chat templates itself, so that a request that
cannot fit is refused before it costs a placement or a cold start.

Every tokenizer call runs on one thread of its own: two threads in `Tokenizer.encode` at once
(of two models) were seen to deadlock inside openvino_genai, which froze every request of the
gateway waiting on them (bench/cluster.py's warm-up, three models at once). A call takes well
under a millisecond, so one thread is no bottleneck, and the event loop never runs one.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import openvino_genai as ov_genai

from shared.messages import Artifact

T = TypeVar("T")


class Tokenizers:
    def __init__(self) -> None:
        self._loaded: dict[str, ov_genai.Tokenizer] = {}
        self._vocab: dict[int, int] = {}
        self._texts: dict[int, dict[int, str]] = {}
        self._lock = asyncio.Lock()
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenizers")

    async def _run(self, fn: Callable[..., T], *args: object) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._thread, fn, *args)

    async def get(self, artifact: Artifact) -> ov_genai.Tokenizer:
        tok = self._loaded.get(artifact.artifact_id)
        if tok is None:
            async with self._lock:
                tok = self._loaded.get(artifact.artifact_id)
                if tok is None:
                    tok = await self._run(ov_genai.Tokenizer, artifact.path)
                    self._loaded[artifact.artifact_id] = tok
        return tok

    async def render_chat(
        self,
        tok: ov_genai.Tokenizer,
        messages: Sequence[dict[str, Any]],
        add_generation_prompt: bool = True,
        chat_template: str = "",
        tools: Sequence[dict[str, Any]] | None = None,
    ) -> str:
        """Through `chat_template` (the registration's) or else the model's own; `tools` go to a
        template that renders them (`knows_tools`)."""
        return await self._run(_render_chat, tok, messages, add_generation_prompt, chat_template, tools)

    @staticmethod
    def knows_tools(tok: ov_genai.Tokenizer, chat_template: str = "") -> bool:
        """Whether the template renders `tools` itself (Qwen's, Hermes', Llama 3.1's do;
        SmolLM2's does not): then the tools are its to show, in the format the model learned."""
        return "tools" in (chat_template or str(tok.chat_template))

    @classmethod
    def bare_json_calls(cls, tok: ov_genai.Tokenizer, chat_template: str = "") -> bool:
        """Whether such a template has the model answer a call as a bare JSON object (Llama
        3.1's) rather than in `<tool_call>` blocks (Qwen's, Hermes')."""
        return cls.knows_tools(tok, chat_template) and "<tool_call>" not in (chat_template or str(tok.chat_template))

    async def encode(self, tok: ov_genai.Tokenizer, text: str) -> tuple[int, ...]:
        return await self._run(_encode, tok, text)

    async def decode(self, tok: ov_genai.Tokenizer, ids: Sequence[int]) -> str:
        return await self._run(_decode, tok, ids)

    async def token_texts(self, tok: ov_genai.Tokenizer, ids: Sequence[int]) -> dict[int, str]:
        """Each id's own text, as logprobs show it (vLLM's: the token decoded alone; a piece of a
        character shows as U+FFFD). Remembered per tokenizer: a crowd asks for the same ids."""
        known = self._texts.setdefault(id(tok), {})
        missing = sorted({i for i in ids if i not in known})
        if missing:
            for i, text in zip(missing, await self._run(_decode_each, tok, missing), strict=True):
                known[i] = text
        return {i: known[i] for i in ids}

    async def vocab_size(self, tok: ov_genai.Tokenizer) -> int:
        key = id(tok)
        if key not in self._vocab:
            # get_vocab, not get_vocab_vector: the vector's strings fail to decode for
            # byte-level tokens (a UnicodeDecodeError on SmolLM2's).
            self._vocab[key] = await self._run(lambda: len(tok.get_vocab()))
        return self._vocab[key]


def _render_chat(
    tok: ov_genai.Tokenizer,
    messages: Sequence[dict[str, Any]],
    add_generation_prompt: bool,
    chat_template: str,
    tools: Sequence[dict[str, Any]] | None,
) -> str:
    return str(
        tok.apply_chat_template(
            list(messages),
            add_generation_prompt=add_generation_prompt,
            chat_template=chat_template,
            tools=list(tools) if tools else None,
        )
    )


def _encode(tok: ov_genai.Tokenizer, text: str) -> tuple[int, ...]:
    return tuple(int(i) for i in tok.encode(text).input_ids.data[0])


def _decode(tok: ov_genai.Tokenizer, ids: Sequence[int]) -> str:
    return str(tok.decode(list(ids)))


def _decode_each(tok: ov_genai.Tokenizer, ids: Sequence[int]) -> list[str]:
    return [str(t) for t in tok.decode([[i] for i in ids], skip_special_tokens=False)]

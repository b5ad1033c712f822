"""The chat and text completion shapes of an answer (`completion.ResponseShape`): each leg a
choice under its index, put back together into one OpenAI answer, streamed or not.

Also what a choice's text becomes on the way out: tool calls read from it (`tools.py`),
logprobs with each token's text, `echo`'s prompt in front, and `best_of`'s ranking.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from typing import Any

from services.gateway.completion import Leg, LegEvent, ResponseShape, usage
from services.gateway.generation import Prepared
from services.gateway.openai_format import (
    Shape,
    chat_logprobs,
    completion_logprobs,
    error_body,
    finish_reason,
    sse,
)
from services.gateway.protocol import ChatCompletionRequest, CompletionRequest
from services.gateway.serving import Gateway
from services.gateway.tool_stream import ToolStream
from services.gateway.tools import parse
from shared.errors import TesseraError
from shared.messages import Finished, TokenLogprob


def _best(legs: list[Leg], n: int) -> list[Leg]:
    """best_of: per prompt, the `n` generations of highest log-probability (vLLM's
    cumulative logprob), numbered again from each prompt's first choice."""
    kept: list[Leg] = []
    by_prompt: dict[int, list[Leg]] = {}
    for leg in legs:
        by_prompt.setdefault(leg.prompt_index, []).append(leg)
    for p_i, group in sorted(by_prompt.items()):
        ranked = sorted(group, key=lambda g: -sum(e.logprob for e in g.logprobs))[:n]
        for j, leg in enumerate(ranked):
            leg.index = p_i * n + j
            kept.append(leg)
    return kept


async def _token_texts(gateway: Gateway, prepared: Prepared, entries: Sequence[TokenLogprob]) -> dict[int, str]:
    """The text of every token in `entries`, chosen and alternatives."""
    ids = {i for e in entries for i in (e.token, *(t for t, _ in e.top))}
    if not ids:
        return {}
    tok = await gateway.tokenizers.get(prepared.record.artifact)
    return await gateway.tokenizers.token_texts(tok, sorted(ids))


class Choices:
    """A chat or text completion's answer: `shape` names its fields."""

    terminator = sse("[DONE]")

    def __init__(self, gateway: Gateway, req: ChatCompletionRequest | CompletionRequest, shape: Shape) -> None:
        self.gateway = gateway
        self.req = req
        self.shape = shape

    @staticmethod
    def of(gateway: Gateway, req: ChatCompletionRequest | CompletionRequest) -> Callable[[list[Leg]], ResponseShape]:
        """The shape for `req`'s opened legs (its id is its first generation's)."""

        def shape_of(legs: list[Leg]) -> ResponseShape:
            first = legs[0].gen
            assert first is not None
            chat = isinstance(req, ChatCompletionRequest)
            return Choices(gateway, req, Shape(chat, first.request_id, legs[0].prepared.name))

        return shape_of

    async def answer(self, legs: list[Leg]) -> dict[str, Any]:
        req, shape = self.req, self.shape
        prompt_tokens, completion_tokens = usage(legs)
        chosen = _best(legs, req.choices()) if req.candidates() > req.choices() else legs
        wants_logprobs = req.logprob_count() >= 0
        entries = [e for leg in chosen for e in leg.logprobs]
        texts = await _token_texts(self.gateway, legs[0].prepared, entries) if wants_logprobs else {}
        choices = []
        for leg in sorted(chosen, key=lambda g: g.index):
            assert leg.finished is not None
            text, finish = "".join(leg.text), finish_reason(leg.finished)
            logprobs = None
            if wants_logprobs:
                logprobs = (
                    chat_logprobs(leg.logprobs, texts)
                    if shape.chat
                    else completion_logprobs(leg.logprobs, texts, len(leg.echo))
                )
            plan = leg.prepared.tools
            if shape.chat and plan is not None and plan.mode != "none":
                content, calls = parse(text, plan)
                if calls and plan.mode != "named":
                    finish = "tool_calls"
                choices.append(shape.choice(leg.index, content, finish, logprobs, calls or None))
            else:
                choices.append(shape.choice(leg.index, leg.echo + text, finish, logprobs))
        return shape.full(choices, prompt_tokens, completion_tokens)

    async def stream(self, legs: list[Leg], events: AsyncIterator[LegEvent]) -> AsyncGenerator[str, None]:
        """Every leg's chunks as they come, each under its choice's index; usage (if asked)
        once all have finished. An error of one leg ends the answer."""
        req, shape = self.req, self.shape
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        wants_logprobs = req.logprob_count() >= 0
        tools = {
            leg.index: ToolStream(leg.prepared.tools)
            for leg in legs
            if shape.chat and leg.prepared.tools is not None and leg.prepared.tools.mode != "none"
        }
        offsets = {leg.index: len(leg.echo) for leg in legs}
        for leg in legs:
            if shape.chat:
                yield sse(shape.chunk("", role=True, index=leg.index))
            if leg.echo:
                yield sse(shape.chunk(leg.echo, index=leg.index))
        try:
            async for leg, event in events:
                if isinstance(event, Finished):
                    for part in self._finish(leg, event, tools.get(leg.index)):
                        yield part
                    continue
                logprobs = None
                if wants_logprobs and event.logprobs:
                    texts = await _token_texts(self.gateway, leg.prepared, event.logprobs)
                    if shape.chat:
                        logprobs = chat_logprobs(event.logprobs, texts)
                    else:
                        logprobs = completion_logprobs(event.logprobs, texts, offsets[leg.index])
                        offsets[leg.index] += sum(len(texts[e.token]) for e in event.logprobs)
                tool = tools.get(leg.index)
                if tool is not None:
                    for i, delta in enumerate(tool.feed(event.text)):
                        yield sse(
                            shape.chunk(None, index=leg.index, delta=delta, logprobs=logprobs if i == 0 else None)
                        )
                elif event.text or logprobs:
                    yield sse(shape.chunk(event.text, index=leg.index, logprobs=logprobs))
        except TesseraError as e:
            # Headers are gone already: the error travels as an SSE event the openai client raises.
            yield sse(error_body(e.status, e.message, e.code.value, e.param))
            return
        if include_usage:
            yield sse(shape.usage_chunk(*usage(legs)))

    def _finish(self, leg: Leg, event: Finished, tool: ToolStream | None) -> list[str]:
        shape = self.shape
        parts = []
        finish = finish_reason(event)
        if tool is not None:
            parts += [sse(shape.chunk(None, index=leg.index, delta=delta)) for delta in tool.finish()]
            if tool.called and leg.prepared.tools is not None and leg.prepared.tools.mode != "named":
                finish = "tool_calls"
        chunk = shape.chunk(None if shape.chat else "", finish, index=leg.index, delta={} if shape.chat else None)
        return [*parts, sse(chunk)]

"""A completion request's choices: `n`, `best_of` and a list of prompts, each choice a
generation of its own on the engine (they share their prompt's prefix in its KV cache: the
core caches prefixes), put back together into one OpenAI answer, streamed or not.

Also what a choice's text becomes on the way out: tool calls read from it (`tools.py`),
logprobs with each token's text, and `echo`'s prompt in front.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

import msgspec

from services.gateway.auth import Grant, Principal, Quotas
from services.gateway.openai_format import (
    Shape,
    chat_logprobs,
    completion_logprobs,
    error_body,
    finish_reason,
    sse,
)
from services.gateway.protocol import ChatCompletionRequest, CompletionRequest
from services.gateway.serving import Gateway, Generation, Prepared
from services.gateway.tool_stream import ToolStream
from services.gateway.tools import parse
from shared.errors import TesseraError
from shared.messages import ErrorCode, Finished, TokenChunk, TokenLogprob

_CLOSING: set[asyncio.Future[None]] = set()


@dataclass
class Leg:
    """One generation: choice `index` of its prompt (`prompt_index`)."""

    index: int
    prompt_index: int
    prepared: Prepared
    echo: str
    gen: Generation | None = None
    grant: Grant | None = None
    produced: int = 0
    text: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finished: Finished | None = None


def legs_of(req: ChatCompletionRequest | CompletionRequest, prepared: Sequence[Prepared]) -> list[Leg]:
    """`candidates()` generations per prompt. A seeded request's k-th candidate samples with
    seed + k: the same request gives the same choices, and its choices differ."""
    k = req.candidates()
    echo = isinstance(req, CompletionRequest) and req.echo
    legs = []
    for p_i, p in enumerate(prepared):
        for j in range(k):
            params = p.params
            if j and params.seed is not None:
                params = msgspec.structs.replace(params, seed=(params.seed + j) % 2**64)
            legs.append(
                Leg(
                    p_i * k + j,
                    p_i,
                    Prepared(p.record, p.prompt, p.prompt_ids, params, p.tools),
                    p.prompt if echo else "",
                )
            )
    return legs


async def open_legs(gateway: Gateway, quotas: Quotas, who: Principal, legs: Sequence[Leg]) -> None:
    """Admit and place every leg (placement and cold start happen before any byte is sent);
    if one cannot start, those already open are closed and the error goes to the client."""
    limit = gateway.settings.max_inflight
    if len(legs) > limit:  # its own legs would wait in line behind each other
        raise TesseraError(
            ErrorCode.INVALID_REQUEST,
            f"{len(legs)} generations (n, best_of, prompts) are more than this gateway runs at once ({limit})",
            param="n",
        )
    try:
        for leg in legs:
            p = leg.prepared
            leg.grant = await quotas.admit(who, p.prompt_tokens, p.params.max_tokens)
            leg.gen = await gateway.open(p)
    except BaseException:
        await close_legs(quotas, legs)
        raise


async def close_legs(quotas: Quotas, legs: Sequence[Leg]) -> None:
    for leg in legs:
        if leg.gen is not None:
            await leg.gen.close()
            leg.gen = None
        if leg.grant is not None:
            await quotas.settle(leg.grant, leg.produced)
            leg.grant = None


def _usage(legs: Sequence[Leg]) -> tuple[int, int]:
    """(prompt tokens: each prompt once, completion tokens: every generation's, best_of's too)."""
    prompts = {leg.prompt_index: leg.finished.prompt_tokens for leg in legs if leg.finished is not None}
    return sum(prompts.values()), sum(leg.finished.completion_tokens for leg in legs if leg.finished)


async def _collect(leg: Leg) -> None:
    assert leg.gen is not None
    async with aclosing(leg.gen.events()) as events:
        async for event in events:
            if isinstance(event, Finished):
                leg.finished = event
                leg.produced = event.completion_tokens
                return
            leg.text.append(event.text)
            leg.logprobs.extend(event.logprobs)
            leg.produced += event.tokens


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


async def answer(
    gateway: Gateway, req: ChatCompletionRequest | CompletionRequest, shape: Shape, legs: list[Leg]
) -> dict[str, Any]:
    """The whole answer, once every leg has finished."""
    await asyncio.gather(*(_collect(leg) for leg in legs))
    prompt_tokens, completion_tokens = _usage(legs)
    chosen = _best(legs, req.choices()) if req.candidates() > req.choices() else legs
    wants_logprobs = req.logprob_count() >= 0
    entries = [e for leg in chosen for e in leg.logprobs]
    texts = await _token_texts(gateway, legs[0].prepared, entries) if wants_logprobs else {}
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


async def _token_texts(gateway: Gateway, prepared: Prepared, entries: Sequence[TokenLogprob]) -> dict[int, str]:
    """The text of every token in `entries`, chosen and alternatives."""
    ids = {i for e in entries for i in (e.token, *(t for t, _ in e.top))}
    if not ids:
        return {}
    tok = await gateway.tokenizers.get(prepared.record.artifact)
    return await gateway.tokenizers.token_texts(tok, sorted(ids))


async def _events(leg: Leg, out: asyncio.Queue[tuple[Leg, TokenChunk | Finished | BaseException]]) -> None:
    assert leg.gen is not None
    try:
        async with aclosing(leg.gen.events()) as events:
            async for event in events:
                await out.put((leg, event))
    except BaseException as e:  # to the stream: it ends the whole answer
        await out.put((leg, e))


async def stream(
    gateway: Gateway, req: ChatCompletionRequest | CompletionRequest, shape: Shape, legs: list[Leg], quotas: Quotas
) -> AsyncIterator[str]:
    """Every leg's chunks as they come, each under its choice's index; usage (if asked) once
    all have finished; `[DONE]`. An error of one leg ends the answer."""
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    wants_logprobs = req.logprob_count() >= 0
    queue: asyncio.Queue[tuple[Leg, TokenChunk | Finished | BaseException]] = asyncio.Queue()
    tasks = [asyncio.ensure_future(_events(leg, queue)) for leg in legs]
    tools = {
        leg.index: ToolStream(leg.prepared.tools)
        for leg in legs
        if shape.chat and leg.prepared.tools is not None and leg.prepared.tools.mode != "none"
    }
    offsets = {leg.index: len(leg.echo) for leg in legs}
    try:
        for leg in legs:
            if shape.chat:
                yield sse(shape.chunk("", role=True, index=leg.index))
            if leg.echo:
                yield sse(shape.chunk(leg.echo, index=leg.index))
        running = len(legs)
        while running:
            leg, event = await queue.get()
            if isinstance(event, BaseException):
                if isinstance(event, TesseraError):
                    # Headers are gone already: the error travels as an SSE event the openai
                    # client raises.
                    yield sse(error_body(event.status, event.message, event.code.value, event.param))
                    break
                raise event
            if isinstance(event, Finished):
                running -= 1
                leg.finished = event
                leg.produced = event.completion_tokens
                finish = finish_reason(event)
                tool = tools.get(leg.index)
                if tool is not None:
                    for delta in tool.finish():
                        yield sse(shape.chunk(None, index=leg.index, delta=delta))
                    if tool.called and leg.prepared.tools is not None and leg.prepared.tools.mode != "named":
                        finish = "tool_calls"
                yield sse(
                    shape.chunk(None if shape.chat else "", finish, index=leg.index, delta={} if shape.chat else None)
                )
                continue
            leg.produced += event.tokens
            logprobs = None
            if wants_logprobs and event.logprobs:
                texts = await _token_texts(gateway, leg.prepared, event.logprobs)
                if shape.chat:
                    logprobs = chat_logprobs(event.logprobs, texts)
                else:
                    logprobs = completion_logprobs(event.logprobs, texts, offsets[leg.index])
                    offsets[leg.index] += sum(len(texts[e.token]) for e in event.logprobs)
            tool = tools.get(leg.index)
            if tool is not None:
                deltas = tool.feed(event.text)
                for i, delta in enumerate(deltas):
                    yield sse(shape.chunk(None, index=leg.index, delta=delta, logprobs=logprobs if i == 0 else None))
            elif event.text or logprobs:
                yield sse(shape.chunk(event.text, index=leg.index, logprobs=logprobs))
        else:
            if include_usage:
                yield sse(shape.usage_chunk(*_usage(legs)))
    finally:
        # A client that went away cancels this generator inside Starlette's cancelled scope,
        # where every further await is cancelled again: the legs are closed by a task of
        # their own (their engines stop, their admission slots and quotas come back) that
        # this only waits for.
        for task in tasks:
            task.cancel()
        closing = asyncio.ensure_future(_close(tasks, quotas, legs))
        _CLOSING.add(closing)  # the loop keeps only a weak reference to a task
        closing.add_done_callback(_CLOSING.discard)
        await asyncio.shield(closing)
    yield sse("[DONE]")


async def _close(tasks: Sequence[asyncio.Future[None]], quotas: Quotas, legs: Sequence[Leg]) -> None:
    await asyncio.gather(*tasks, return_exceptions=True)
    await close_legs(quotas, legs)

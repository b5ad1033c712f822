"""The one completion path: chat completions, text completions and Responses all come here, and
differ only in their `ResponseShape` (llama.cpp's server: one completion handler, the response
format a parameter).

A request becomes legs, one generation each (`n`, `best_of`, a list of prompts; they share their
prompt's prefix in the engine's KV cache). Every leg is admitted against its caller's quotas and
placed (cold start included) before any byte is sent; its tokens are relayed; and it is always
closed, whatever ends it (its end, an error, the client leaving): its engine stops, its gateway
slot and its quota come back.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec
from fastapi.responses import JSONResponse, Response, StreamingResponse

from services.gateway import cold
from services.gateway.auth import Grant, Principal, Quotas, check_model
from services.gateway.protocol import ChatCompletionRequest, CompletionRequest
from services.gateway.serving import Gateway, Generation, Prepared
from shared.errors import TesseraError
from shared.messages import ErrorCode, Finished, TokenChunk, TokenLogprob

_CLOSING: set[asyncio.Future[None]] = set()
"""Closings under way (the loop keeps only a weak reference to a task)."""


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


LegEvent = tuple[Leg, TokenChunk | Finished]
"""A leg's chunk or its end, as streamed (the leg's counts already updated)."""


class ResponseShape(Protocol):
    """What one API makes of a completion's legs."""

    terminator: str
    """Sent after the legs are closed, at the end of a stream ("" for none)."""

    async def answer(self, legs: list[Leg]) -> dict[str, Any]:
        """The whole body, once every leg has finished (`collect`)."""
        ...

    def stream(self, legs: list[Leg], events: AsyncIterator[LegEvent]) -> AsyncGenerator[str, None]:
        """The streamed body of `legs` from their events as they come. A leg's `TesseraError` is
        raised out of `events`; headers are sent by then, so the shape says it in its own
        events and ends; any other exception ends the stream."""
        ...


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
                    dataclasses.replace(p, params=params),
                    p.prompt if echo else "",
                )
            )
    return legs


async def open_legs(
    gateway: Gateway, quotas: Quotas, who: Principal, legs: Sequence[Leg], max_wait_s: float | None = None
) -> None:
    """Admit and place every leg (placement and cold start happen before any byte is sent);
    if one cannot start, those already open are closed and the error goes to the client.
    `max_wait_s`: the request's cold-start budget."""
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
            leg.gen = await gateway.open(p, max_wait_s)
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


def usage(legs: Sequence[Leg]) -> tuple[int, int]:
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


async def collect(legs: Sequence[Leg]) -> None:
    """Every leg run to its end: its text, logprobs and `Finished` kept on it."""
    await asyncio.gather(*(_collect(leg) for leg in legs))


async def _read(leg: Leg, out: asyncio.Queue[tuple[Leg, TokenChunk | Finished | BaseException]]) -> None:
    assert leg.gen is not None
    try:
        async with aclosing(leg.gen.events()) as events:
            async for event in events:
                await out.put((leg, event))
    except BaseException as e:  # to the stream: it ends the whole answer
        await out.put((leg, e))


async def _merged(
    legs: Sequence[Leg], queue: asyncio.Queue[tuple[Leg, TokenChunk | Finished | BaseException]]
) -> AsyncGenerator[LegEvent, None]:
    running = len(legs)
    while running:
        leg, event = await queue.get()
        if isinstance(event, BaseException):
            raise event
        if isinstance(event, Finished):
            running -= 1
            leg.finished = event
            leg.produced = event.completion_tokens
        else:
            leg.produced += event.tokens
        yield leg, event


async def stream(shape: ResponseShape, legs: list[Leg], quotas: Quotas) -> AsyncIterator[str]:
    """`shape`'s stream over every leg's events as they come; then the legs closed, however the
    stream ended; then the shape's terminator."""
    queue: asyncio.Queue[tuple[Leg, TokenChunk | Finished | BaseException]] = asyncio.Queue()
    readers = [asyncio.ensure_future(_read(leg, queue)) for leg in legs]
    try:
        async with aclosing(_merged(legs, queue)) as events, aclosing(shape.stream(legs, events)) as body:
            async for part in body:
                yield part
    finally:
        # A client that went away cancels this generator inside Starlette's cancelled scope,
        # where every further await is cancelled again: the legs are closed by a task of
        # their own (their engines stop, their admission slots and quotas come back) that
        # this only waits for.
        for reader in readers:
            reader.cancel()
        closing = asyncio.ensure_future(_close(readers, quotas, legs))
        _CLOSING.add(closing)
        closing.add_done_callback(_CLOSING.discard)
        await asyncio.shield(closing)
    if shape.terminator:
        yield shape.terminator


async def _close(readers: Sequence[asyncio.Future[None]], quotas: Quotas, legs: Sequence[Leg]) -> None:
    await asyncio.gather(*readers, return_exceptions=True)
    await close_legs(quotas, legs)


async def complete(
    gateway: Gateway,
    quotas: Quotas,
    who: Principal,
    req: ChatCompletionRequest | CompletionRequest,
    shape_of: Callable[[list[Leg]], ResponseShape],
    max_wait: str | None = None,
) -> Response:
    """Serve `req` (a Responses request comes as the chat request it is served as), answered in
    the shape `shape_of` makes for its opened legs. `max_wait`: the `X-Tessera-Max-Wait`
    header's value, if sent."""
    for name in (req.model, *(req.models or ())):
        check_model(who, name)
    budget = cold.max_wait_s(max_wait, req.tessera.max_wait_s if req.tessera else None)
    legs = legs_of(req, await gateway.prepare_all(req))
    await open_legs(gateway, quotas, who, legs, budget)
    try:
        shape = shape_of(legs)
        gens = [leg.gen for leg in legs]
        headers = cold.cold_start_header(
            [g.placed if g else None for g in gens], [g.start_waited_s if g else 0.0 for g in gens]
        )
    except BaseException:
        await close_legs(quotas, legs)
        raise
    if req.stream:
        return StreamingResponse(
            stream(shape, legs, quotas),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **headers},
        )
    try:
        await collect(legs)
        return JSONResponse(await shape.answer(legs), headers=headers)
    finally:
        await close_legs(quotas, legs)

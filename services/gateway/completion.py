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
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec
from fastapi.responses import JSONResponse, Response, StreamingResponse

from services.gateway import cold
from services.gateway.auth import ApiError, Grant, Principal, Quotas, check_model
from services.gateway.generation import Generation, Prepared
from services.gateway.loading import ENDED, KEEPALIVE_S, Lines, Placing, StartWatch
from services.gateway.openai_format import error_body, sse
from services.gateway.protocol import ChatCompletionRequest, CompletionRequest
from services.gateway.serving import Gateway
from shared.errors import TesseraError
from shared.messages import ErrorCode, Finished, StartProgress, TokenChunk, TokenLogprob

log = logging.getLogger(__name__)

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
    gateway: Gateway,
    quotas: Quotas,
    who: Principal,
    legs: Sequence[Leg],
    max_wait_s: float | None = None,
    placing: Placing | None = None,
) -> None:
    """Admit and place every leg (placement and cold start happen before any token is sent;
    a stream may show the start's progress meanwhile: `placing`); if one cannot start, those
    already open are closed and the error goes to the client. `max_wait_s`: the request's
    cold-start budget."""
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
            leg.gen = await gateway.open(p, max_wait_s, placing)
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
    stream_error: Callable[[int, str, str | None, str | None], str] | None = None,
) -> Response:
    """Serve `req` (a Responses request comes as the chat request it is served as), answered in
    the shape `shape_of` makes for its opened legs. `max_wait`: the `X-Tessera-Max-Wait`
    header's value, if sent. `stream_error`: the API's error event (status, message, code,
    param), for a start that fails after a stream showing its progress began (chat's
    `{"error": ...}` by default)."""
    for name in (req.model, *(req.models or ())):
        check_model(who, name)
    budget = cold.max_wait_s(max_wait, req.tessera.max_wait_s if req.tessera else None)
    legs = legs_of(req, await gateway.prepare_all(req))
    if req.stream and budget is None:
        # Placed in a task of its own: if its model's start reports progress first, the stream
        # begins now and shows it (`loading`); else it is answered as before. (With a budget,
        # its refusal must be a status: `loading`.)
        placing = Placing()
        opening = asyncio.ensure_future(open_legs(gateway, quotas, who, legs, budget, placing))
        try:
            first = await _start_seen(gateway.starts, placing, opening)
        except BaseException:  # the client left
            _abandon(opening, quotas, legs)
            raise
        if first is not None:
            body = _loading_then(gateway.starts, placing, first, opening, legs, quotas, shape_of, stream_error)
            return StreamingResponse(body, media_type="text/event-stream", headers=dict(_SSE_HEADERS))
        await opening
    else:
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
            headers={**_SSE_HEADERS, **headers},
        )
    try:
        await collect(legs)
        return JSONResponse(await shape.answer(legs), headers=headers)
    finally:
        await close_legs(quotas, legs)


_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def chat_stream_error(status: int, message: str, code: str | None, param: str | None) -> str:
    """The error event of a chat or text completion stream, then its `[DONE]` (the openai
    client raises the error)."""
    return sse(error_body(status, message, code, param)) + sse("[DONE]")


async def _start_seen(
    watch: StartWatch, placing: Placing, opening: asyncio.Future[None]
) -> tuple[StartProgress, float] | None:
    """The progress event that begins the stream of a request waiting on a start, or None once
    its legs are open (or failed) first. The stream begins at the start's second event, or a
    keep-alive interval after its first: a start that fails at once (its memory refused, its
    worker gone) is still answered with its HTTP error, a 503 with `Retry-After`, not an event
    in a stream already begun; an ended start ("ready", "failed") begins none (its placement's
    answer is on its way)."""
    first: float | None = None
    while not opening.done():
        wait = KEEPALIVE_S
        if (seen := watch.under_way(placing)) is not None and seen[0].phase not in ENDED:
            if first is None:
                first = seen[1]
            elif seen[1] > first:
                return seen
            wait = first + KEEPALIVE_S - time.monotonic()
            if wait <= 0:
                return seen
        news = asyncio.ensure_future(watch.news(wait))
        try:
            await asyncio.wait({opening, news}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            news.cancel()
    return None


async def _loading_then(
    watch: StartWatch,
    placing: Placing,
    first: tuple[StartProgress, float],
    opening: asyncio.Future[None],
    legs: list[Leg],
    quotas: Quotas,
    shape_of: Callable[[list[Leg]], ResponseShape],
    stream_error: Callable[[int, str, str | None, str | None], str] | None,
) -> AsyncIterator[str]:
    """A stream that began during its model's start: a comment line per progress event (the
    last one again each `KEEPALIVE_S` between events) until its legs are open, then the
    start's cost as a comment (its `x-tessera-cold-start`, too late for a header), then the
    answer as `stream` writes it; a failure to open, as the API's error event."""
    lines, began = Lines(), False
    (event, at), written = first, time.monotonic()
    try:
        yield lines.line(event, time.monotonic() - at)
        while not opening.done():
            news = asyncio.ensure_future(watch.news(KEEPALIVE_S))
            try:
                await asyncio.wait({opening, news}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                news.cancel()
            newer = watch.under_way(placing)
            now = time.monotonic()
            if newer is not None and newer[1] > at:
                (event, at), written = newer, now
                yield lines.line(event, now - at)
            elif now - written >= KEEPALIVE_S:
                written = now
                yield lines.line(event, now - at)
        if (error := _failure(opening)) is not None:
            yield (stream_error or chat_stream_error)(*error)
            return
        # Its last event (the instance ready) came before its placement did.
        if (last := watch.latest.get(event.model)) is not None and last[1] > at:
            yield lines.line(last[0], time.monotonic() - last[1])
        gens = [leg.gen for leg in legs]
        cost = cold.cold_start_header(
            [g.placed if g else None for g in gens], [g.start_waited_s if g else 0.0 for g in gens]
        )
        if cost:
            yield f": tessera cold-start {cost[cold.COLD_START_HEADER]}\n\n"
        shape = shape_of(legs)
        began = True
        async for part in stream(shape, legs, quotas):
            yield part
    finally:
        if not began:
            _abandon(opening, quotas, legs)


def _failure(opening: asyncio.Future[None]) -> tuple[int, str, str | None, str | None] | None:
    """Why the legs could not open (status, message, code, param), or None if they did."""
    e = opening.exception()
    if e is None:
        return None
    if isinstance(e, TesseraError):
        return e.status, e.message, e.code.value, e.param
    if isinstance(e, ApiError):
        return e.status, e.message, e.code, e.param
    log.error("a streamed request failed before its first token", exc_info=e)
    return 500, "internal error", "internal_error", None


def _abandon(opening: asyncio.Future[None], quotas: Quotas, legs: list[Leg]) -> None:
    """The request ended before its answer began (its client left, or it failed): placing
    still, its task is cancelled (`open_legs` closes what it opened); opened, its legs are
    closed by a task of their own (no await here: this may run in a cancelled scope)."""
    if not opening.done():
        opening.cancel()
    elif not opening.cancelled() and opening.exception() is None:
        closing = asyncio.ensure_future(close_legs(quotas, legs))
        _CLOSING.add(closing)
        closing.add_done_callback(_CLOSING.discard)

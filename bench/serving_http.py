"""The load over HTTP in `bench/serving.py` (Tessera's gateway, llama-server): streamed chat
completions from back-to-back clients, each concurrency level, and the mixed run."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable
from typing import Any

import httpx

from bench.common import ChatStream, chat_body
from bench.serving_memory import RssSampler
from bench.serving_runs import (
    LONG_TOKENS,
    MAX_TOKENS,
    MIXED_SHORT_CLIENTS,
    PROMPTS,
    REQUEST_TIMEOUT_S,
    Outcome,
    Run,
    log_level,
    log_mixed,
    summarize,
    summarize_mixed,
    timed_outcome,
)

# --- clients over HTTP (Tessera's gateway, llama-server) -----------------------------------------


async def stream_request(http: httpx.AsyncClient, body: dict[str, Any], chat: ChatStream | None = None) -> Outcome:
    """One streamed chat completion, timed from just before it is sent. `chat` (given by the
    caller) lets a caller that cancels it see the tokens so far."""
    chat = chat or ChatStream()
    sent = time.perf_counter()
    try:
        async with http.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                await r.aread()
                retry_after = float(r.headers.get("retry-after", "0") or 0)
                return Outcome(str(r.status_code), retry_after_s=retry_after)
            async for line in r.aiter_lines():
                if not chat.feed(line):
                    break
    except httpx.TimeoutException:
        return Outcome("timeout")
    except httpx.HTTPError:
        return Outcome("transport")
    if chat.problem() is not None:
        return Outcome("stream_error", len(chat.arrivals))
    tokens = int((chat.usage or {}).get("completion_tokens", len(chat.arrivals)))
    return timed_outcome(sent, chat.arrivals, tokens)


async def client_loop(
    http: httpx.AsyncClient, model: str, index: int, more: Callable[[], bool], out: list[Outcome]
) -> None:
    """One client: requests back to back while `more()`; after a 429/503 it waits the
    `Retry-After` it was given, as a polite client does."""
    k = 0
    while more():
        body = chat_body(model, PROMPTS[(index + k) % len(PROMPTS)], MAX_TOKENS, ignore_eos=True)
        outcome = await stream_request(http, body)
        out.append(outcome)
        k += 1
        wake = time.perf_counter() + outcome.retry_after_s
        while more() and time.perf_counter() < wake:  # noqa: ASYNC110 (no wait past the run's end)
            await asyncio.sleep(0.05)


async def http_run(base_url: str, model: str, clients: int, duration_s: float, long_tokens: int = 0) -> Run:
    """`clients` clients back to back for `duration_s`; with `long_tokens`, one long request is
    started first (the clock starts at its first token) and the clients stop when it ends.
    A long request still running when the clients stop is cancelled (its stream closed)."""
    limits = httpx.Limits(max_connections=clients + 8, max_keepalive_connections=clients + 8)
    timeout = httpx.Timeout(REQUEST_TIMEOUT_S, connect=30.0)
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout, limits=limits) as http:
        long_task: asyncio.Task[Outcome] | None = None
        long_chat = ChatStream()
        if long_tokens:
            started = asyncio.Event()
            long_chat.on_chunk = lambda n: started.set()
            long_task = asyncio.create_task(
                stream_request(http, chat_body(model, PROMPTS[0], long_tokens, ignore_eos=True), long_chat)
            )
            waiter = asyncio.create_task(started.wait())
            await asyncio.wait({long_task, waiter}, return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()
        t0 = time.perf_counter()
        deadline = t0 + duration_s

        def more() -> bool:
            return time.perf_counter() < deadline and not (long_task is not None and long_task.done())

        outcomes: list[Outcome] = []
        await asyncio.gather(*(client_loop(http, model, i, more, outcomes) for i in range(clients)))
        wall = time.perf_counter() - t0
        long = await finish_long(long_task, long_chat)
    return Run(outcomes, wall, long, t0=t0, window_s=duration_s)


async def finish_long(task: asyncio.Task[Outcome] | None, chat: ChatStream) -> Outcome | None:
    """The long request's outcome; still running, it is cancelled and reported as "running"
    with the tokens it had streamed."""
    if task is None:
        return None
    if task.done():
        return task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    return Outcome("running", len(chat.arrivals))


def bench_http(
    base_url: str,
    model: str,
    levels: list[int],
    duration_s: float,
    pids: Callable[[], Iterable[int]],
    label: str,
    mixed_run: bool = True,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Every concurrency level, then (with `mixed_run`) the mixed run (alone, then with the
    long request)."""
    out: dict[str, Any] = {}
    for c in levels:
        with RssSampler(pids) as rss:
            run = asyncio.run(http_run(base_url, model, c, duration_s))
        run.peak_rss_bytes = rss.peak
        out[str(c)] = summarize(run, MAX_TOKENS)
        log_level(label, c, out[str(c)])
    if not mixed_run:
        return out, {}
    alone = asyncio.run(http_run(base_url, model, MIXED_SHORT_CLIENTS, duration_s))
    mixed = asyncio.run(http_run(base_url, model, MIXED_SHORT_CLIENTS, duration_s, LONG_TOKENS))
    result = summarize_mixed(alone, mixed)
    log_mixed(label, result)
    return out, result

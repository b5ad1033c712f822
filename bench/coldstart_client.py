"""The settings of `bench/coldstart.py`, its client of the cluster (the bench model's streamed
request, cache eviction), and the burst of concurrent first requests on the model scaled to zero."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx

from bench.common import (
    COLDSTART_LOG_TIMEOUT_S,
    EVICT_TIMEOUT_S,
    ChatStream,
    TesseraClient,
    chat_body,
    make_log,
    percentile,
    resident_ids,
    stream_chat,
)

MODEL_NAME = "bench-smollm2-135m"
KEEP_ALIVE_S = 1.0
PROMPT = "Write a short poem about the sea."  # the same prompt as bench/peers.py
COLD_MAX_TOKENS = 16
DECODE_TOKENS = 128

BURST_SIZE = 16
BURST_MAX_TOKENS = 8

BURST_REQUEST_TIMEOUT_S = 180.0
BURST_SETTLE_S = 2.0

log = make_log("bench")


# --- Tessera -------------------------------------------------------------------------------------


class Tessera(TesseraClient):
    """The client, with the bench model's streamed request and cache eviction."""

    def wait_zero(self) -> float:
        """Wait until the bench model is scaled to zero; the seconds it took."""
        return self.wait_scaled_to_zero(MODEL_NAME, note=f" (keep-alive {KEEP_ALIVE_S}s)")

    def stream(self, max_tokens: int, ignore_eos: bool = False) -> dict[str, Any]:
        """One streamed chat request; times from just before sending it."""
        res = stream_chat(self.http, chat_body(MODEL_NAME, PROMPT, max_tokens, ignore_eos))
        sent, arrivals = res["sent"], res["arrivals"]
        return {
            "sent_wall": res["sent_wall"],
            "ttft_s": arrivals[0] - sent,
            "first": arrivals[0],
            "last": arrivals[-1],
            "usage": res["usage"],
            "text": "".join(res["chunks"]),
        }

    def evict(self, artifact_id: str, tier: str = "resident", timeout_s: float = EVICT_TIMEOUT_S) -> dict[str, Any]:
        """`POST /admin/cache/evict?tier=<tier>` until the bench model's artifact is among the
        resident models dropped (`host` and `all` drop the resident models too, then the deeper
        caches); see `TesseraClient.evict_until`."""
        answers, evict_s = self.evict_until(artifact_id, {"tier": tier}, timeout_s)
        freed: dict[str, int] = {}
        for e in (e for answer in answers for e in answer):
            t = str(e.get("tier"))
            freed[t] = freed.get(t, 0) + int(e.get("freed_bytes", 0))
        return {
            "tier": tier,
            "freed_bytes": sum(freed.values()),
            "freed_bytes_by_tier": freed,
            "artifact_ids": resident_ids(answers[-1]),
            "calls": len(answers),
            "evict_s": evict_s,
        }


async def _burst_one(http: httpx.AsyncClient) -> dict[str, Any]:
    """One streamed request of the burst: its TTFT, or the status/error that ended it."""
    t0 = time.perf_counter()
    chat = ChatStream()
    async with http.stream("POST", "/v1/chat/completions", json=chat_body(MODEL_NAME, PROMPT, BURST_MAX_TOKENS)) as r:
        if r.status_code != 200:
            await r.aread()
            return {"ok": False, "status": r.status_code, "error": r.text[:300]}
        async for line in r.aiter_lines():
            if not chat.feed(line):
                break
    problem = chat.problem()
    if problem is not None:
        return {"ok": False, "status": 200, "error": problem}
    return {"ok": True, "status": 200, "ttft_s": chat.arrivals[0] - t0}


async def _burst(base_url: str, n: int) -> list[dict[str, Any]]:
    limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
    timeout = httpx.Timeout(BURST_REQUEST_TIMEOUT_S, connect=10.0)
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout, limits=limits) as http:

        async def bounded(i: int) -> dict[str, Any]:
            # A hard bound on the whole request (httpx's timeouts are per read, not total).
            try:
                return await asyncio.wait_for(_burst_one(http), BURST_REQUEST_TIMEOUT_S)
            except TimeoutError:
                return {"ok": False, "status": None, "error": f"no end within {BURST_REQUEST_TIMEOUT_S}s"}
            except httpx.HTTPError as e:
                return {"ok": False, "status": None, "error": f"{type(e).__name__}: {e}"}

        results = await asyncio.gather(*(bounded(i) for i in range(n)))
    return [{"index": i, **r} for i, r in enumerate(results)]


def burst(client: Tessera, n: int) -> dict[str, Any]:
    """n concurrent first requests on the model scaled to zero; how many starts they caused."""
    sent_wall = time.time()
    t0 = time.perf_counter()
    results = asyncio.run(_burst(client.base_url, n))
    wall = time.perf_counter() - t0
    ok = [r for r in results if r["ok"]]
    # The start's record is written once its first token is out; wait for it (bounded), then a
    # little longer so that a second start, if the burst caused one, is counted too.
    starts: list[dict[str, Any]] = []
    deadline = time.monotonic() + COLDSTART_LOG_TIMEOUT_S
    while time.monotonic() < deadline:
        starts = client.cold_starts_since(MODEL_NAME, sent_wall)
        if starts:
            break
        time.sleep(0.1)
    time.sleep(BURST_SETTLE_S)
    starts = client.cold_starts_since(MODEL_NAME, sent_wall)
    ttfts = [r["ttft_s"] for r in ok]
    return {
        "n": n,
        "succeeded": len(ok),
        "ttft_p50_s": percentile(ttfts, 50) if ttfts else None,
        "ttft_p99_s": percentile(ttfts, 99) if ttfts else None,
        "cold_starts": len(starts),
        "errors": [{"index": r["index"], "status": r["status"], "error": r["error"]} for r in results if not r["ok"]],
        "ttft_runs_s": sorted(ttfts),
        "cold_start_sources": [e.get("source") for e in starts],
        "wall_s": wall,
        "max_tokens": BURST_MAX_TOKENS,
    }

"""Tessera in `bench/serving.py`: the model registered and warmed, driven through the gateway;
and the structured-output run (json_schema against plain generation, and what logprobs cost)."""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

from bench.common import chat_body
from bench.serving_http import bench_http, stream_request
from bench.serving_memory import descendants
from bench.serving_runs import (
    EXTRA_ENV,
    MAX_TOKENS,
    MODEL_NAME,
    PROMPTS,
    REQUEST_TIMEOUT_S,
    TESSERA_REGISTRATION,
    THREADS,
    Measured,
    Outcome,
    log,
)
from ops.localcluster import LocalCluster, default_model_path

# --- Tessera -------------------------------------------------------------------------------------


def register(cluster: LocalCluster, gguf: Path) -> dict[str, Any]:
    """Register the model (this converts the GGUF into the store; not measured)."""
    r = httpx.post(
        f"{cluster.base_url}/admin/models",
        headers=cluster.admin_headers,
        timeout=900,
        json={"name": MODEL_NAME, "source": str(gguf), **TESSERA_REGISTRATION},
    )
    r.raise_for_status()
    return dict(r.json())


async def one_request(base_url: str, model: str) -> Outcome:
    async with httpx.AsyncClient(base_url=base_url, timeout=httpx.Timeout(REQUEST_TIMEOUT_S)) as http:
        return await stream_request(http, chat_body(model, PROMPTS[0], MAX_TOKENS, ignore_eos=True))


def warm(base_url: str, model: str, label: str) -> None:
    """One request, not measured (it starts Tessera's instance); fail loudly if it fails, and
    say so if `ignore_eos` was not honoured."""
    o = asyncio.run(one_request(base_url, model))
    if o.status != "ok":
        raise RuntimeError(f"{label}'s warm-up request failed: {o}")
    if o.tokens != MAX_TOKENS:
        log(f"WARNING: {label} answered {o.tokens} tokens, not {MAX_TOKENS}: ignore_eos not honoured")


def _on_core(cluster: LocalCluster) -> bool:
    status = httpx.get(f"{cluster.base_url}/admin/instances", headers=cluster.admin_headers, timeout=10).json()
    return any(i["tier"] == "steady" for n in status["nodes"] for i in n["instances"])


def bench_tessera(
    cluster: LocalCluster, reg: dict[str, Any], levels: list[int], duration_s: float, mixed_run: bool = True
) -> Measured:
    """Through the gateway; memory = the engine service's worker processes."""
    warm(cluster.base_url, MODEL_NAME, "tessera")
    # Steady state is what is compared: a start serves its first requests on the start tier
    # while the continuous-batching core builds (≈ 2.5 s); wait for the hand-over.
    deadline = time.monotonic() + 120
    while not _on_core(cluster) and time.monotonic() < deadline:
        time.sleep(0.2)  # sync-ok: polling a condition with a deadline
    engine_pid = cluster.procs["engine@node-0"].pid
    by_level, mixed = bench_http(
        cluster.base_url, MODEL_NAME, levels, duration_s, lambda: descendants(engine_pid), "tessera", mixed_run
    )
    return by_level, mixed, {"registration": {k: reg.get(k) for k in ("name", *TESSERA_REGISTRATION)}}


# --- structured output (issue 18): json_schema against plain generation, same run ---------------

STRUCTURED_CLIENTS = 8
STRUCTURED_MAX_TOKENS = 160
STRUCTURED_SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 80},
        "mood": {"type": "string", "enum": ["calm", "busy", "sad", "happy"]},
        "lines": {"type": "integer"},
    },
    "required": ["title", "mood", "lines"],
    "additionalProperties": False,
}


async def structured_load(
    base_url: str, model: str, duration_s: float, schema: dict[str, Any] | None, extra: dict[str, Any] | None = None
) -> dict[str, Any]:
    """STRUCTURED_CLIENTS clients back to back (non-streamed, greedy, same prompts), with the
    JSON schema enforced or not: completion tokens per second of the run, and the share of
    answers that parse and validate against the schema."""
    import jsonschema_rs

    body_format = (
        {}
        if schema is None
        else {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "poem", "schema": schema, "strict": True},
            }
        }
    )
    done: list[tuple[int, bool]] = []
    errors: Counter[str] = Counter()

    async def client(http: httpx.AsyncClient, index: int, deadline: float) -> None:
        k = 0
        while time.perf_counter() < deadline:
            prompt = (
                PROMPTS[(index + k) % len(PROMPTS)] + " Answer as JSON with a title, a mood and the number of lines."
            )
            body = {
                "model": model,
                "messages": [{"role": "user", "content": prompt}],
                "temperature": 0,
                "max_tokens": STRUCTURED_MAX_TOKENS,
                **body_format,
                **(extra or {}),
            }
            k += 1
            r = await http.post("/v1/chat/completions", json=body)
            if r.status_code != 200:
                errors[str(r.status_code)] += 1
                continue
            answer = r.json()
            text = answer["choices"][0]["message"]["content"] or ""
            try:
                jsonschema_rs.validate(schema or {}, json.loads(text))
                valid = True
            except ValueError:
                valid = False
            done.append((int(answer["usage"]["completion_tokens"]), valid))

    async with httpx.AsyncClient(base_url=base_url, timeout=REQUEST_TIMEOUT_S) as http:
        t0 = time.perf_counter()
        await asyncio.gather(*(client(http, i, t0 + duration_s) for i in range(STRUCTURED_CLIENTS)))
        wall = time.perf_counter() - t0
    return {
        "tok_s": round(sum(n for n, _ in done) / wall, 1),
        "requests": len(done),
        "tokens": sum(n for n, _ in done),
        "valid_share": round(sum(v for _, v in done) / len(done), 3) if done else None,
        "errors": dict(errors),
        "wall_s": round(wall, 2),
    }


def bench_structured(duration_s: float, home: Path) -> dict[str, Any]:
    """Tessera at c=STRUCTURED_CLIENTS: json_schema, plain answers of the same length, json_schema
    again (`tok_s` is the mean of the two), then what logprobs cost: the chosen token's, and
    with 5 alternatives."""
    cluster = LocalCluster(
        home=home / "home", store=home / "store", env={"TESSERA_INFERENCE_THREADS": str(THREADS), **EXTRA_ENV}
    )
    try:
        cluster.start(timeout_s=120.0)
        register(cluster, default_model_path())
        warm(cluster.base_url, MODEL_NAME, "tessera")
        deadline = time.monotonic() + 120
        while not _on_core(cluster) and time.monotonic() < deadline:
            time.sleep(0.2)  # sync-ok: polling a condition with a deadline
        # The JSON answers end when their object closes (≈ 30 tokens): the plain run's answers
        # are made as long (ignore_eos, max_tokens = their mean), so that the two differ in the
        # grammar alone, not in how much prefill each token carries. Structured runs bracket
        # the plain one against drift.
        first = asyncio.run(structured_load(cluster.base_url, MODEL_NAME, duration_s, STRUCTURED_SCHEMA))
        mean = max(1, round(first["tokens"] / max(first["requests"], 1)))
        plain_run = asyncio.run(
            structured_load(cluster.base_url, MODEL_NAME, duration_s, None, {"max_tokens": mean, "ignore_eos": True})
        )
        second = asyncio.run(structured_load(cluster.base_url, MODEL_NAME, duration_s, STRUCTURED_SCHEMA))
        # What logprobs cost, same load: the chosen token's (the library's, on the core), and
        # 5 alternatives (read from the logits on the stateful tier).
        # What logprobs cost, at the plain run's shape: the chosen token's (the library's, on
        # the core), and 5 alternatives (read from the logits on the stateful tier).
        shape = {"max_tokens": mean, "ignore_eos": True}
        chosen = asyncio.run(
            structured_load(cluster.base_url, MODEL_NAME, duration_s, None, {**shape, "logprobs": True})
        )
        top5 = asyncio.run(
            structured_load(
                cluster.base_url, MODEL_NAME, duration_s, None, {**shape, "logprobs": True, "top_logprobs": 5}
            )
        )
    finally:
        cluster.stop()
    structured = (first["tok_s"] + second["tok_s"]) / 2
    plain = plain_run["tok_s"]
    valid = min(first["valid_share"] or 0.0, second["valid_share"] or 0.0)
    ratio = round(structured / plain, 3) if plain else None
    out = {
        "tok_s": round(structured, 1),
        "plain_tok_s": plain,
        "valid_share": valid,
        "ratio": ratio,
        "clients": STRUCTURED_CLIENTS,
        "max_tokens": STRUCTURED_MAX_TOKENS,
        "plain_max_tokens": mean,
        "schema": STRUCTURED_SCHEMA,
        "runs": {"structured_before": first, "plain": plain_run, "structured_after": second},
        "targets": {"valid_share": {"value": valid, "target": "== 1.0"}, "ratio": {"value": ratio, "target": ">= 0.8"}},
    }
    out["logprobs"] = {
        "chosen_tok_s": chosen["tok_s"],
        "top5_tok_s": top5["tok_s"],
        "plain_tok_s": plain,
        "chosen_ratio": round(chosen["tok_s"] / plain, 3) if plain else None,
        "top5_ratio": round(top5["tok_s"] / plain, 3) if plain else None,
        "runs": {"chosen": chosen, "top5": top5},
    }
    log(
        f"structured: {out['tok_s']} tok/s against plain {out['plain_tok_s']} ({out['ratio']}x), "
        f"valid {out['valid_share']}; logprobs: chosen {out['logprobs']['chosen_ratio']}x, "
        f"top 5 {out['logprobs']['top5_ratio']}x plain"
    )
    return out

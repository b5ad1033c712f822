"""Many fine-tunes on one base (issue 34): 100 LoRA adapters registered on the default model, a
cold adapter's first token on a warm base, a crowd spread over 8 adapters against the same crowd
on the base alone, and the node's memory for it; llama-server with the same adapters beside it.

    python -m bench.adapters [--adapters 100] [--active 8] [--clients 32] [--peft 4]
        [--duration 20] [--max-tokens 32] [--cold-trials 2] [--out bench/results]

One run, in this order (progress on stderr):

1. **The adapters**: `--peft` made with PEFT on the Hugging Face form of SmolLM2-135M-Instruct
   (`bench/shaped_models.py --form hf`), the rest perturbed copies of them (`bench/adapter_files.py`);
   the `--active` ones the crowd uses converted to GGUF LoRA by llama.cpp's
   `convert_lora_to_gguf.py` for llama-server.
2. **Tessera**, a `LocalCluster` (2 inference threads) in a temporary home: the Hugging Face form
   registered as the base, every adapter registered on it (`POST /admin/models/{base}/adapters`),
   then
   - the base's first start (not measured), then for each active adapter a request to the warm
     base (`base_warm_ttft_s`: their median) and the adapter's first request ever
     (`adapter_cold_ttft_s`: their median; its response's `model` must be the adapter's name);
   - `--clients` streams on the base alone (`base_c32_tok_s`), then the same crowd spread over the
     active adapters round robin (`mixed_c32_tok_s`), each for `--duration` seconds;
   - the node's memory: the peak RSS of the engine's process tree (the engine and its workers)
     during each crowd (`node_memory_bytes` is the mixed crowd's, with 100 registered and the
     active ones loaded; `base_memory_bytes` the base crowd's), and the node's booked memory
     (`memory_used_bytes` of its heartbeat) after each;
   - the base scaled to zero (its `KEEP_ALIVE_S`), every cache dropped (`/admin/cache/evict?tier=all`)
     and requested again: a full cold start from the disk (`base_cold_ttft_s`, `--cold-trials`);
     once more with a never-used adapter as the request (`adapter_on_cold_base_ttft_s`: the
     base's start and the adapter's load together).
3. **A torch node** (`TESSERA_ENGINE_BACKEND=torch`, `--torch`, on by default): the same base
   and the `--active` adapters on a cluster of one torch node, the same two crowds
   (`torch_node`: `base_c32_tok_s`, `mixed_c32_tok_s`). OpenVINO GenAI applies one adapter set
   to a whole step, so the OpenVINO node batches by adapter; the torch engine applies each row's
   own in one step (`services/engine/torch_engine/lora.py`): the mixed crowd's cost there is the
   low-rank updates alone.
4. **llama-server** on the same model's GGUF, started with `--lora` for each active adapter and
   `--lora-init-without-apply` (every adapter at scale 0 unless a request names it): the same warm
   base / first-use adapter pairs (a request names its adapter with `"lora": [{"id": i, "scale":
   1.0}]`; llama-server loads every adapter at its start, so its "cold" adapter is a first use),
   the same two crowds, and a fresh process's cold start (`bench/peers.py`).

Writes `<out>/adapters.json` and `<out>/adapters.png` and prints the JSON. A run in which Tessera
could not serve the adapters writes `<out>/adapters-incomplete.json` instead (and exits 1).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

if __package__ in (None, ""):  # `python bench/adapters.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import shaped_models
from bench.adapter_files import make_adapters, to_ggufs
from bench.coldstart_peers import run_peer
from bench.common import ChatStream, TesseraClient, chat_body, machine_info, make_log, median
from bench.llama_server import LlamaServer
from bench.serving_http import stream_request
from bench.serving_memory import RssSampler, descendants
from bench.serving_report import ratio
from bench.serving_runs import LLAMA_SLOT_TOKENS, PROMPTS, REPO_ROOT, THREADS, Run, summarize

log = make_log("adapters")
BASE = "bench-adapters-base"
KEEP_ALIVE_S = 10.0
"""The base's and every adapter's: short, so that the base's cold trials need not wait long for
its scale to zero, long enough that it stays warm between the steps before them."""
REGISTRATION = {"ttft_slo_s": 10.0, "tpot_slo_s": 1.0, "keep_alive_s": KEEP_ALIVE_S}
"""Generous SLOs: admission never refuses what the engine could serve (throughput is measured)."""
REGISTER_TIMEOUT_S = 1800.0
ADAPTER_SCALE = 1.0
"""llama-server's per-request scale: its GGUF LoRA keeps PEFT's alpha, so 1.0 is PEFT's update."""
COLD_RECORD_WAIT_S = 2.0
"""How long to look for an adapter start's cold-start record (an engine may write none)."""
UNLOAD_WAIT_S = KEEP_ALIVE_S + 60.0
MEMORY_TARGET = 1.10
"""Node memory with 100 registered and the active adapters at most (base + active adapters) x this."""


def adapter_name(i: int) -> str:
    return f"bench-lora-{i:03d}"


# --- requests ------------------------------------------------------------------------------------


class ModelStream(ChatStream):
    """A chat stream that also keeps the `model` its chunks name (an adapter's must be its own)."""

    def __init__(self) -> None:
        super().__init__()
        self.model: str | None = None

    def feed(self, line: str) -> bool:
        if self.model is None and line.startswith("data:") and line[5:].strip() != "[DONE]":
            try:
                self.model = json.loads(line[5:]).get("model")
            except ValueError:
                pass
        return super().feed(line)


def first_token(http: httpx.Client, body: dict[str, Any]) -> dict[str, Any]:
    """One streamed request: its TTFT, text, the `model` it was answered as, and when it was sent."""
    sent_wall, sent = time.time(), time.perf_counter()
    chat = ModelStream()
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            r.read()
            raise RequestRefused(r.status_code, r.text[:500])
        for line in r.iter_lines():
            if not chat.feed(line):
                break
    if (problem := chat.problem()) is not None:
        raise RuntimeError(f"{body['model']}: {problem}")
    return {
        "sent_wall": sent_wall,
        "ttft_s": chat.arrivals[0] - sent,
        "text": "".join(chat.chunks),
        "model": chat.model,
    }


class RequestRefused(RuntimeError):
    def __init__(self, status: int, text: str) -> None:
        super().__init__(f"HTTP {status}: {text}")
        self.status, self.text = status, text


async def crowd_run(base_url: str, body: Callable[[int, int], dict[str, Any]], clients: int, duration_s: float) -> Run:
    """`clients` back-to-back clients for `duration_s`; client i's k-th request is `body(i, k)`.
    A refused request's client waits its `Retry-After` (at least 0.1 s) before the next."""
    limits = httpx.Limits(max_connections=clients + 8, max_keepalive_connections=clients + 8)
    timeout = httpx.Timeout(REGISTER_TIMEOUT_S, connect=30.0)
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout, limits=limits) as http:
        t0 = time.perf_counter()
        deadline = t0 + duration_s
        outcomes = []

        async def client(i: int) -> None:
            k = 0
            while time.perf_counter() < deadline:
                outcome = await stream_request(http, body(i, k))
                outcomes.append(outcome)
                k += 1
                if outcome.status != "ok":
                    await asyncio.sleep(min(max(outcome.retry_after_s, 0.1), max(deadline - time.perf_counter(), 0)))

        await asyncio.gather(*(client(i) for i in range(clients)))
        wall = time.perf_counter() - t0
    return Run(outcomes, wall, t0=t0, window_s=duration_s)


def crowd(
    base_url: str,
    body: Callable[[int, int], dict[str, Any]],
    args: argparse.Namespace,
    pids: Callable[[], list[int]],
    label: str,
) -> dict[str, Any]:
    """One crowd of `args.clients` for `args.duration`, with the peak RSS of `pids` meanwhile."""
    with RssSampler(pids) as rss:
        run = asyncio.run(crowd_run(base_url, body, args.clients, args.duration))
    run.peak_rss_bytes = rss.peak
    res = summarize(run, args.max_tokens)
    log(
        f"{label} c={args.clients}: {res['tok_s'] or 0:.1f} tok/s, {res['completed']}/{res['requests']} ok, "
        f"errors {res['errors']}, peak rss {rss.peak / 2**20:.0f} MiB"
    )
    return res


def request_body(model: str, args: argparse.Namespace, k: int = 0, **extra: Any) -> dict[str, Any]:
    return {**chat_body(model, PROMPTS[k % len(PROMPTS)], args.max_tokens, ignore_eos=True), **extra}


def pairs(http: httpx.Client, base: Callable[[], dict[str, Any]], adapters: list[dict[str, Any]]) -> dict[str, Any]:
    """For each adapter body: a request to the warm base, then the adapter's first request."""
    out: dict[str, Any] = {"base_warm": [], "adapter_cold": []}
    for body in adapters:
        out["base_warm"].append(first_token(http, base()))
        out["adapter_cold"].append(first_token(http, body))
        log(
            f"base warm {out['base_warm'][-1]['ttft_s'] * 1000:.0f} ms, "
            f"adapter {body['model']}{body.get('lora', '')} first {out['adapter_cold'][-1]['ttft_s'] * 1000:.0f} ms"
        )
    return out


# --- Tessera -------------------------------------------------------------------------------------


class Client(TesseraClient):
    def register(self, path: str, body: dict[str, Any]) -> tuple[dict[str, Any], float]:
        t0 = time.perf_counter()
        r = self.http.post(path, json={**body, **REGISTRATION}, timeout=REGISTER_TIMEOUT_S)
        if r.status_code >= 400:
            raise RuntimeError(f"POST {path} {body['name']}: HTTP {r.status_code}: {r.text[:500]}")
        return dict(r.json()), time.perf_counter() - t0

    def node(self) -> dict[str, Any]:
        return dict(self.http.get("/admin/instances", timeout=10).raise_for_status().json()["nodes"][0])

    def base_instance(self) -> dict[str, Any]:
        return next((i for i in self.node().get("instances", ()) if i.get("model") == BASE), {})

    def cold_record(self, model: str, sent_wall: float) -> dict[str, Any] | None:
        try:
            return self.cold_start_after(model, sent_wall, timeout_s=COLD_RECORD_WAIT_S)
        except TimeoutError:
            return None

    def full_cold(self, body: dict[str, Any], artifact_id: str) -> dict[str, Any]:
        """`body` (a request to the base or one of its adapters) sent once the base has scaled
        to zero and every cache below it was dropped."""
        self.wait_scaled_to_zero(BASE, UNLOAD_WAIT_S)
        if artifact_id in self.node().get("resident", ()):
            self.evict_until(artifact_id, {"tier": "all"})
        else:  # not kept resident when idle: the caches below
            self.http.post("/admin/cache/evict", params={"tier": "all"}, timeout=30).raise_for_status()
        res = first_token(self.http, body)
        res["record"] = self.cold_record(BASE, res["sent_wall"])
        if body["model"] != BASE:  # the adapter's own start record, beside its base's
            res["adapter_record"] = self.cold_record(body["model"], res["sent_wall"])
        log(f"{body['model']} on a cold base: ttft {res['ttft_s']:.2f}s, source {(res['record'] or {}).get('source')}")
        return res


def register_all(client: Client, base_hf: Path, adapters: list[Path]) -> dict[str, Any]:
    reg, base_s = client.register("/admin/models", {"name": BASE, "source": str(base_hf)})
    log(f"{BASE} registered from {base_hf} in {base_s:.1f}s")
    records, times = [], []
    for i, path in enumerate(adapters):
        rec, s = client.register(f"/admin/models/{BASE}/adapters", {"name": adapter_name(i), "source": str(path)})
        records.append(rec)
        times.append(s)
    listed = client.http.get(f"/admin/models/{BASE}/adapters", timeout=30).raise_for_status().json()
    log(f"{len(records)} adapters registered (median {median(times) * 1000:.0f} ms each); {len(listed)} listed")
    return {
        "artifact": reg["artifact"],
        "register_s": base_s,
        "adapter_register_s": times,
        "adapter_bytes": [int(r.get("adapter", {}).get("nbytes", 0)) for r in records],
        "listed": len(listed),
    }


def tessera_torch(base_hf: Path, adapters: list[Path], home: Path, args: argparse.Namespace) -> dict[str, Any]:
    """The base and the active adapters on one torch node: the base's crowd, then the mixed one."""
    from ops.localcluster import LocalCluster

    env = {"TESSERA_INFERENCE_THREADS": str(THREADS), "TESSERA_ENGINE_BACKEND": "torch"}
    cluster = LocalCluster(home=home / "torch-home", store=home / "torch-store", env=env)
    cluster.start(timeout_s=120.0)
    client = Client(cluster.base_url)
    client.http.headers.update(cluster.admin_headers)
    try:
        out = register_all(client, base_hf, adapters[: args.active])
        engine_pid = cluster.procs["engine@node-0"].pid

        def pids() -> list[int]:
            return [engine_pid, *descendants(engine_pid)]

        names = [adapter_name(i) for i in range(args.active)]
        out["base_text"] = first_token(client.http, request_body(BASE, args))["text"]
        out["adapter_texts"] = [first_token(client.http, request_body(n, args))["text"] for n in names]
        out["base_crowd"] = crowd(
            cluster.base_url, lambda i, k: request_body(BASE, args, i + k), args, pids, "torch base"
        )
        out["mixed_crowd"] = crowd(
            cluster.base_url, lambda i, k: request_body(names[i % len(names)], args, i + k), args, pids, "torch mixed"
        )
        return out
    finally:
        client.close()
        cluster.stop()


def tessera(base_hf: Path, adapters: list[Path], home: Path, args: argparse.Namespace) -> dict[str, Any]:
    from ops.localcluster import LocalCluster

    cluster = LocalCluster(home=home / "home", store=home / "store", env={"TESSERA_INFERENCE_THREADS": str(THREADS)})
    cluster.start(timeout_s=120.0)
    client = Client(cluster.base_url)
    client.http.headers.update(cluster.admin_headers)
    try:
        out = register_all(client, base_hf, adapters)
        engine_pid = cluster.procs["engine@node-0"].pid

        def pids() -> list[int]:
            return [engine_pid, *descendants(engine_pid)]

        first = first_token(client.http, request_body(BASE, args))
        log(f"{BASE} first start: ttft {first['ttft_s']:.2f}s")
        out["base_text"] = first["text"]
        out["base_crowd"] = crowd(cluster.base_url, lambda i, k: request_body(BASE, args, i + k), args, pids, "base")
        out["base_booked_bytes"] = client.node()["memory_used_bytes"]
        try:
            out.update(tessera_adapters(client, cluster.base_url, args, pids))
        except RequestRefused as e:  # adapters registered, not served (the engine cannot apply them)
            log(f"adapter requests refused: {e}")
            out["adapter_error"] = str(e)
        cold = [
            client.full_cold(request_body(BASE, args), out["artifact"]["artifact_id"]) for _ in range(args.cold_trials)
        ]
        out["base_cold"] = cold
        if "adapter_error" not in out and args.adapters > args.active:
            out["adapter_on_cold_base"] = client.full_cold(
                request_body(adapter_name(args.active), args), out["artifact"]["artifact_id"]
            )
        return out
    finally:
        client.close()
        cluster.stop()


def tessera_adapters(
    client: Client, base_url: str, args: argparse.Namespace, pids: Callable[[], list[int]]
) -> dict[str, Any]:
    """The warm base / cold adapter pairs, the mixed crowd, and the memory with the active loaded."""
    names = [adapter_name(i) for i in range(args.active)]
    out: dict[str, Any] = {}
    out["pairs"] = pairs(client.http, lambda: request_body(BASE, args), [request_body(n, args) for n in names])
    out["adapter_cold_records"] = [
        client.cold_record(n, r["sent_wall"]) for n, r in zip(names, out["pairs"]["adapter_cold"], strict=True)
    ]
    out["answered_as"] = [r["model"] for r in out["pairs"]["adapter_cold"]]
    out["mixed_crowd"] = crowd(
        base_url, lambda i, k: request_body(names[i % len(names)], args, i + k), args, pids, "mixed"
    )
    out["mixed_booked_bytes"] = client.node()["memory_used_bytes"]
    out["loaded_adapters"] = list(client.base_instance().get("adapters", ()))
    log(f"loaded on the base's instance after the mixed crowd: {out['loaded_adapters']}")
    return out


# --- llama-server --------------------------------------------------------------------------------


def llama_server(gguf: Path, loras: list[Path], args: argparse.Namespace) -> dict[str, Any]:
    lora_flags = [flag for p in loras for flag in ("--lora", str(p))]
    extra = ["--cont-batching", "--kv-unified", "--jinja", *lora_flags, "--lora-init-without-apply"]
    out: dict[str, Any] = {}
    t0 = time.perf_counter()
    with LlamaServer(
        gguf, threads=THREADS, ctx=args.clients * LLAMA_SLOT_TOKENS, parallel=args.clients, extra=extra
    ) as server:
        out["start_s"] = time.perf_counter() - t0
        out["cmd"] = server.cmd
        with httpx.Client(base_url=server.base_url, timeout=REGISTER_TIMEOUT_S) as http:
            listed = http.get("/lora-adapters").raise_for_status().json()
            ids = {Path(a["path"]).name: int(a["id"]) for a in listed}
            lora_ids = [ids[p.name] for p in loras]
            # `--lora-init-without-apply` only leaves them off the context at its start: a
            # request without `lora` takes the server's list, every adapter at its --lora
            # scale (1.0). Set to 0, as /lora-adapters allows, a base request is the base's.
            http.post("/lora-adapters", json=[{"id": i, "scale": 0.0} for i in lora_ids]).raise_for_status()
            out["lora_adapters"] = http.get("/lora-adapters").raise_for_status().json()
            if any(a["scale"] != 0.0 for a in out["lora_adapters"]):
                raise RuntimeError(f"llama-server's adapters not all at scale 0: {out['lora_adapters']}")
            out["base_text"] = first_token(http, request_body("gguf", args))["text"]  # warm-up

            def lora(j: int) -> list[dict[str, Any]]:
                return [{"id": lora_ids[j], "scale": ADAPTER_SCALE}]

            out["pairs"] = pairs(
                http,
                lambda: request_body("gguf", args),
                [request_body("gguf", args, lora=lora(j)) for j in range(len(loras))],
            )
        out["base_crowd"] = crowd(
            server.base_url, lambda i, k: request_body("gguf", args, i + k), args, lambda: [server.pid], "llama base"
        )
        out["mixed_crowd"] = crowd(
            server.base_url,
            lambda i, k: request_body("gguf", args, i + k, lora=lora(i % len(loras))),
            args,
            lambda: [server.pid],
            "llama mixed",
        )
    out["cold_ttft_trials_s"] = [run_peer("llamacpp", gguf)["cold_ttft_s"] for _ in range(args.cold_trials)]
    log(f"llama.cpp fresh process cold: {out['cold_ttft_trials_s']}")
    return out


# --- the result ----------------------------------------------------------------------------------


def med(runs: list[dict[str, Any]] | None, key: str = "ttft_s") -> float | None:
    return median([r[key] for r in runs]) if runs else None


def figures(sys_: dict[str, Any]) -> dict[str, Any]:
    """The issue's figures of one system (None where it did not get that far)."""
    p = sys_.get("pairs") or {}
    mixed = sys_.get("mixed_crowd") or {}
    return {
        "adapter_cold_ttft_s": med(p.get("adapter_cold")),
        "base_warm_ttft_s": med(p.get("base_warm")),
        "mixed_c32_tok_s": mixed.get("tok_s"),
        "base_c32_tok_s": sys_["base_crowd"]["tok_s"],
        "adapters_change_output": (sum(r["text"] != sys_["base_text"] for r in p["adapter_cold"]) if p else None),
        "adapter_texts_distinct": len({r["text"] for r in p["adapter_cold"]}) if p else None,
    }


def result(
    t: dict[str, Any], ll: dict[str, Any], args: argparse.Namespace, tt: dict[str, Any] | None = None
) -> dict[str, Any]:
    tf = figures(t)
    active_bytes = sum(t["adapter_bytes"][: args.active])
    node_rss = (t.get("mixed_crowd") or {}).get("peak_rss_bytes")
    base_rss = t["base_crowd"]["peak_rss_bytes"]
    base_cold = med(t["base_cold"])
    res: dict[str, Any] = {
        "adapters_registered": t["listed"],
        "adapter_cold_ttft_s": tf["adapter_cold_ttft_s"],
        "base_warm_ttft_s": tf["base_warm_ttft_s"],
        "base_cold_ttft_s": base_cold,
        "mixed_c32_tok_s": tf["mixed_c32_tok_s"],
        "base_c32_tok_s": tf["base_c32_tok_s"],
        "node_memory_bytes": node_rss,
        "node_memory_source": "peak RSS of the engine's process tree (engine + workers) during the mixed crowd",
        "node_memory_booked_bytes": t.get("mixed_booked_bytes"),
        "base_memory_bytes": base_rss,
        "base_memory_booked_bytes": t["base_booked_bytes"],
        "active_adapter_bytes": active_bytes,
        "adapter_on_cold_base_ttft_s": (t.get("adapter_on_cold_base") or {}).get("ttft_s"),
        "adapter_answered_as_itself": (
            t["answered_as"] == [adapter_name(i) for i in range(args.active)] if "answered_as" in t else None
        ),
        "adapters_change_output": tf["adapters_change_output"],
        "adapter_texts_distinct": tf["adapter_texts_distinct"],
        "loaded_adapters": t.get("loaded_adapters"),
        "adapter_error": t.get("adapter_error"),
        "llama_server": {
            **figures(ll),
            "base_cold_ttft_s": median(ll["cold_ttft_trials_s"]),
            "memory_bytes": ll["mixed_crowd"]["peak_rss_bytes"],
            "base_memory_bytes": ll["base_crowd"]["peak_rss_bytes"],
            "start_s": ll["start_s"],
        },
    }
    if tt is not None:
        res["torch_node"] = {
            "base_c32_tok_s": tt["base_crowd"]["tok_s"],
            "mixed_c32_tok_s": tt["mixed_crowd"]["tok_s"],
            "mixed_vs_base_c32": ratio(tt["mixed_crowd"]["tok_s"], tt["base_crowd"]["tok_s"]),
            "adapters_change_output": sum(text != tt["base_text"] for text in tt["adapter_texts"]),
            "adapter_texts_distinct": len(set(tt["adapter_texts"])),
            "errors": {"base": tt["base_crowd"]["errors"], "mixed": tt["mixed_crowd"]["errors"]},
        }
    lf = res["llama_server"]
    res["ratios"] = {
        "adapter_cold_vs_base_warm": ratio(res["adapter_cold_ttft_s"], res["base_warm_ttft_s"]),
        "adapter_cold_vs_base_cold": ratio(res["adapter_cold_ttft_s"], base_cold),
        "mixed_vs_base_c32": ratio(res["mixed_c32_tok_s"], res["base_c32_tok_s"]),
        "memory_vs_base_plus_active": ratio(node_rss, base_rss + active_bytes if base_rss else None),
        "booked_vs_base_plus_active": ratio(res["node_memory_booked_bytes"], t["base_booked_bytes"] + active_bytes),
        "llama_server_adapter_cold_vs_base_warm": ratio(lf["adapter_cold_ttft_s"], lf["base_warm_ttft_s"]),
        "llama_server_mixed_vs_base_c32": ratio(lf["mixed_c32_tok_s"], lf["base_c32_tok_s"]),
        "mixed_c32_vs_llama_server": ratio(res["mixed_c32_tok_s"], lf["mixed_c32_tok_s"]),
        "adapter_cold_vs_llama_server": ratio(res["adapter_cold_ttft_s"], lf["adapter_cold_ttft_s"]),
    }
    r = res["ratios"]

    def at_most(v: float | None, bound: float) -> bool | None:
        return None if v is None else v <= bound

    res["targets"] = {
        "adapters_registered_100": res["adapters_registered"] >= 100,
        "adapter_cold_at_most_1.5x_base_warm": at_most(r["adapter_cold_vs_base_warm"], 1.5),
        "adapter_cold_at_most_0.1x_base_cold": at_most(r["adapter_cold_vs_base_cold"], 0.1),
        "mixed_c32_at_least_0.8x_base": None if r["mixed_vs_base_c32"] is None else r["mixed_vs_base_c32"] >= 0.8,
        "memory_at_most_base_plus_active_plus_10pct": at_most(r["memory_vs_base_plus_active"], MEMORY_TARGET),
    }
    if tt is not None:
        mixed = res["torch_node"]["mixed_vs_base_c32"]
        res["targets"]["torch_node_mixed_c32_at_least_0.8x_base"] = None if mixed is None else mixed >= 0.8
    res["detail"] = {"tessera": t, "llama_server": ll, "torch_node": tt}
    return res


def plot(res: dict[str, Any], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    ll = res["llama_server"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    ttfts = ("base_warm_ttft_s", "adapter_cold_ttft_s", "base_cold_ttft_s")
    x = range(len(ttfts))
    ax1.bar([i - 0.2 for i in x], [res[k] or 0 for k in ttfts], 0.4, label="Tessera")
    ax1.bar([i + 0.2 for i in x], [ll[k] or 0 for k in ttfts], 0.4, label="llama-server")
    ax1.set_xticks(list(x), [k.removesuffix("_ttft_s") for k in ttfts])
    ax1.set_yscale("log")
    ax1.set_ylabel("TTFT (s)")
    ax1.legend(fontsize=8)
    keys = ("base_c32_tok_s", "mixed_c32_tok_s")
    x = range(len(keys))
    tn = res.get("torch_node")
    width = 0.27 if tn else 0.4
    ax2.bar([i - width for i in x], [res[k] or 0 for k in keys], width, label="Tessera (OpenVINO node)")
    if tn:
        ax2.bar(list(x), [tn[k] or 0 for k in keys], width, label="Tessera (torch node, float32)")
    ax2.bar([i + width for i in x], [ll[k] or 0 for k in keys], width, label="llama-server")
    ax2.set_xticks(list(x), [f"{k.split('_')[0]} (c={res['settings']['clients']})" for k in keys])
    ax2.set_ylabel("tok/s")
    ax2.legend(fontsize=8)
    fig.suptitle(
        f"bench/adapters.py: {res['adapters_registered']} adapters, {res['settings']['active']} active, {res['date']}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--adapters", type=int, default=100, help="adapters registered on the base")
    ap.add_argument("--active", type=int, default=8, help="adapters the crowd is spread over")
    ap.add_argument("--clients", type=int, default=32, help="streams in each crowd")
    ap.add_argument("--peft", type=int, default=4, help="adapters made with PEFT (the rest derived from them)")
    ap.add_argument("--duration", type=float, default=20.0, help="seconds each crowd runs")
    ap.add_argument("--max-tokens", type=int, default=32, help="tokens each request generates (ignore_eos)")
    ap.add_argument("--cold-trials", type=int, default=2, help="full cold starts of the base (and of llama.cpp)")
    ap.add_argument(
        "--torch", action=argparse.BooleanOptionalAction, default=True, help="the same crowds on a torch node"
    )
    ap.add_argument("--out", type=Path, default=REPO_ROOT / "bench" / "results")
    args = ap.parse_args(argv)
    if not 1 <= args.active <= args.adapters:
        ap.error("--active must be between 1 and --adapters")
    load_before = os.getloadavg()
    started = time.perf_counter()
    base_hf = shaped_models.hf_form(shaped_models.REAL)
    gguf = shaped_models.ensure(shaped_models.REAL)
    with tempfile.TemporaryDirectory(prefix="tessera-adapters-") as tmp:
        home = Path(tmp)
        t0 = time.perf_counter()
        adapters = make_adapters(base_hf, home / "adapters", args.adapters, args.peft)
        made_s = time.perf_counter() - t0
        loras = to_ggufs(base_hf, adapters[: args.active], home / "gguf")
        log(f"{len(adapters)} adapters made in {made_s:.1f}s ({args.peft} with PEFT); {len(loras)} converted to GGUF")
        t = tessera(base_hf, adapters, home, args)
        tt = tessera_torch(base_hf, adapters, home, args) if args.torch else None
        ll = llama_server(gguf, loras, args)
    res = result(t, ll, args, tt)
    res.update(
        {
            "settings": {k: v for k, v in vars(args).items() if k != "out"} | {"threads": THREADS},
            "base": {"hf": str(base_hf), "gguf": str(gguf), "tessera_artifact": t["artifact"].get("artifact_id")},
            "adapters_made_s": made_s,
            "machine": machine_info(load_before),
            "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            "bench_wall_s": time.perf_counter() - started,
        }
    )
    complete = res["adapter_error"] is None and res["mixed_c32_tok_s"] is not None
    name = "adapters" if complete else "adapters-incomplete"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{name}.json").write_text(json.dumps(res, indent=2) + "\n")
    plot(res, args.out / f"{name}.png")
    print(json.dumps({k: v for k, v in res.items() if k != "detail"}, indent=2))
    if not complete:
        log(f"Tessera did not serve the adapters ({res['adapter_error']}): wrote {name}.json, not adapters.json")
    return 0 if complete else 1


if __name__ == "__main__":
    raise SystemExit(main())

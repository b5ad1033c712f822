"""The node's one tensor arena across the engine's own workers (issue 20: Tangram §3.1 and §4,
TIDAL §5), against an arena per worker.

    python3 -m bench.gpu_arena                        # the default model, this machine's device
    python3 -m bench.gpu_arena --skeleton DIR         # its architecture with random weights (a GPU
                                                      # machine: no model travels), DIR = config + tokenizer
    python3 -m bench.gpu_arena --skeleton DIR --shapes smol,llama3-8b   # and an 8B-shaped Llama

It drives the engine's worker processes (`services/engine/worker_pool.Worker`, backend torch:
the pre-warmed process a torch node runs) over their pipe, as the engine does:

- `node_arena`: the engine's main process owns the node's arena (`NodeArena`: the CUDA
  extension's device allocation, shared by CUDA IPC; a shared host mapping on a CPU) and its
  book; worker A starts the model (the engine copies its weights into the arena from the
  checkpoint file, through the extension's pinned staging on a GPU, while the worker binds it),
  serves a first token, and stops (a model scaled to zero whose worker went, or a crash);
  pre-warmed worker B then starts it again: the weights are still in the arena, so nothing is
  read or copied.
- `own_arena`: the same, each worker with an arena of its own (before this change): each
  worker reads the checkpoint and copies it itself (pageable memory), B everything again.
- `llama3-8b` (with `--skeleton`): the same with Llama-3-8B's architecture, random bf16
  weights, and the vocabulary of the skeleton's tokenizer (so that its tokens decode): about
  15 GB, where the weights, not the worker's other set-up, are most of a start.
- `streaming` (TIDAL §5): a start whose weights were all evicted, admitted once the whole copy
  is in against once M_prefetch bytes are (Eq. 1, with the fill bandwidth and the first
  token's time the first start measured), the rest streaming in behind the forward pass.
- `copies` (CUDA only): a load's batched host-to-device copies through the extension (one call
  issues every chunk) against torch's `copy_` per chunk, many spans that do not coalesce: time
  to issue and GB/s.

Each start is timed from the engine sending `Load` to the worker's reply (`start_s`), then to the
first streamed token of a 16-token prompt (`first_token_s`). `restart_speedup` = own arena's
restart (start + first token) / node arena's. Prints the JSON; writes it to `--out` and a plot
beside it where matplotlib is importable.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PROMPT = tuple(range(100, 116))
T0 = time.perf_counter()


def log(what: str) -> None:
    """Each step to stderr as it begins: a run cut off by its time limit says where it was."""
    print(f"[gpu_arena {time.perf_counter() - T0:7.1f}s] {what}", file=sys.stderr, flush=True)


def checkpoint(work: Path, skeleton: str | None, device: str, shape: str) -> tuple[Any, dict[str, int]]:
    """The model's artifact with its torch checkpoint (what registration writes), and its
    tensors as digest → bytes (what the engine reads from the manifest)."""
    import torch

    from services.loader.torch_checkpoint import host_dtype, materialize, write_checkpoint
    from shared.artifact import torch_checkpoint, torch_tensor_bytes
    from shared.messages import Artifact

    artifact = Artifact(f"bench-arena-{shape}", str(work / shape), "0" * 64, 2048, 0, 0)
    dest = torch_checkpoint(artifact)
    dtype = torch.bfloat16 if device.startswith("cuda") else host_dtype()
    if skeleton is None:
        from ops.localcluster import default_model_path

        materialize(default_model_path(), dest, dtype)
    else:
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, LlamaConfig

        from bench.gpu_coldstart import LLAMA3_8B

        config = AutoConfig.from_pretrained(skeleton)
        if shape == "llama3-8b":
            keep = {k: getattr(config, k) for k in ("vocab_size", "bos_token_id", "eos_token_id")}
            config = LlamaConfig(**{**LLAMA3_8B, **keep})
        torch.manual_seed(0)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        # A tied head is the embedding: the checkpoint holds it once, as registration writes it.
        tensors = {n: p.detach().cpu() for n, p in model.named_parameters()}
        del model
        if device.startswith("cuda"):
            torch.cuda.empty_cache()  # the workers need the device's memory
        write_checkpoint(dest, tensors, config, AutoTokenizer.from_pretrained(skeleton), "random")
    return artifact, torch_tensor_bytes(artifact)


async def first_token(worker: Any, n: int) -> float:
    from services.engine.worker_pool import Cancelled
    from services.engine.worker_wire import Run
    from shared.messages import SamplingParams

    run = Run(f"r{n}", f"s{n}", PROMPT, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), 0.0)
    t = time.perf_counter()
    first = None
    async for _ in worker.generate(run, Cancelled()):
        first = first or time.perf_counter() - t
    assert first is not None
    return first


async def spawn(device: str, threads: int, capacity: int, arena: Any) -> tuple[Any, float]:
    from services.engine.backends import TORCH, WorkerSpec
    from services.engine.worker_pool import Worker

    log(f"spawn a worker on {device}")
    t = time.perf_counter()
    spec = WorkerSpec(device, threads, arena_bytes=capacity, kv_tokens=2048, max_batch=4, arena=arena)
    worker = Worker(TORCH, spec)
    await worker.ready(600)
    return worker, time.perf_counter() - t


async def start(
    worker: Any, artifact: Any, tensors: dict[str, int], n: int, admit_bytes: int | None = None
) -> dict[str, Any]:
    log(f"load on worker {worker.pid} (admit at {admit_bytes} bytes)")
    t = time.perf_counter()
    loaded = await worker.load(artifact, None, None, 600, tensors=tensors, admit_bytes=admit_bytes)
    start_s = time.perf_counter() - t
    log(f"loaded in {start_s:.2f} s; first token")
    ttft = await first_token(worker, n)
    return {
        "start_s": start_s,
        "worker_load_s": loaded.load_s,
        "first_token_s": ttft,
        "start_to_first_token_s": start_s + ttft,
        "reused_bytes": loaded.reused_bytes,
    }


async def scenario(shared: bool, args: argparse.Namespace, artifact: Any, tensors: dict[str, int]) -> dict[str, Any]:
    """A worker starts the model and stops; a pre-warmed worker starts it again; `--restarts`
    times, each on a fresh worker."""
    from services.engine.node_arena import NodeArena

    arena = NodeArena(args.arena_bytes, args.device) if shared else None
    out: dict[str, Any] = {"model_bytes": sum(tensors.values())}
    try:
        current, ready_s = await spawn(args.device, args.threads, args.arena_bytes, arena)
        out["spawn_ready_s"] = [ready_s]
        out["first"] = await start(current, artifact, tensors, 0)
        runs = []
        for i in range(args.restarts):
            fresh, ready_s = await spawn(args.device, args.threads, args.arena_bytes, arena)
            out["spawn_ready_s"].append(ready_s)
            log(f"stop worker {current.pid}")
            await asyncio.to_thread(current.stop)  # its model goes with it, or stays in the node's arena
            current = fresh
            runs.append(await start(current, artifact, tensors, i + 1))
        await asyncio.to_thread(current.stop)
        out["restart_runs"] = runs
        out["restart"] = min(runs, key=lambda r: r["start_to_first_token_s"])
        if arena is not None:
            out["arena_held_idle_bytes"] = arena.held_bytes()
    finally:
        if arena is not None:
            arena.close()
    return out


async def streaming(args: argparse.Namespace, artifact: Any, tensors: dict[str, int]) -> dict[str, Any]:
    """TIDAL §5 on the node's arena: a start whose weights are all missing (evicted), admitted
    once the whole copy is in (`whole`) against once M_prefetch = max(M − T_TTFT × B_h2d, 0)
    bytes are (`streamed`: the rest streams in behind the first forward pass, each unit waiting
    for its own tensors), with B_h2d the fill bandwidth the first start measured and T_TTFT its
    first token's time; interleaved, each on a fresh pre-warmed worker."""
    from policy.prefetch import prefetch_bytes
    from services.engine.node_arena import NodeArena

    arena = NodeArena(args.arena_bytes, args.device)
    model_bytes = sum(tensors.values())
    out: dict[str, Any] = {"model_bytes": model_bytes}
    try:
        worker, _ = await spawn(args.device, args.threads, args.arena_bytes, arena)
        first = await start(worker, artifact, tensors, 0)
        out["h2d_gbps"] = arena.fill_bps / 1e9
        out["ttft_s"] = first["first_token_s"]
        out["prefetch_bytes"] = prefetch_bytes(model_bytes, first["first_token_s"], arena.fill_bps)
        runs: dict[str, list[dict[str, Any]]] = {"whole": [], "streamed": []}
        for i, mode in enumerate(["whole", "streamed"] * args.restarts):
            fresh, _ = await spawn(args.device, args.threads, args.arena_bytes, arena)
            await asyncio.to_thread(worker.stop)
            arena.evict_idle(tensors)  # a miss: every tensor copied again
            worker = fresh
            admit = out["prefetch_bytes"] if mode == "streamed" else None
            runs[mode].append(await start(worker, artifact, tensors, i + 1, admit))
        await asyncio.to_thread(worker.stop)
        for mode, rows in runs.items():
            out[mode] = min(rows, key=lambda r: r["start_to_first_token_s"])
        out["speedup"] = out["whole"]["start_to_first_token_s"] / out["streamed"]["start_to_first_token_s"]
    finally:
        arena.close()
    return out


def copies(args: argparse.Namespace) -> dict[str, Any]:
    """Many spans that do not coalesce (a gap after each), host → device: the extension's one
    call against torch's copy per chunk."""
    import torch

    from cuda_ext.build import ensure
    from cuda_ext.copies import CopyEngine, Span

    ensure()
    out: dict[str, Any] = {}
    for name, count, size in (("small", 4096, 64 << 10), ("large", 128, 8 << 20)):
        src = torch.empty(count * size, dtype=torch.uint8, pin_memory=True).fill_(3)
        dst = torch.empty(2 * count * size, dtype=torch.uint8, device="cuda")
        spans = [[Span(src[i * size : (i + 1) * size], dst[2 * i * size : (2 * i + 1) * size])] for i in range(count)]
        row: dict[str, Any] = {"spans": count, "span_bytes": size}
        for native in (False, True, False, True):
            engine = CopyEngine(torch.device("cuda"), streams=4, native=native)
            issue, total = [], []
            for _ in range(5):
                torch.cuda.synchronize()
                t = time.perf_counter()
                transfer = engine.copy(spans)
                t1 = time.perf_counter()
                transfer.synchronize()
                t2 = time.perf_counter()
                issue.append(t1 - t)
                total.append(t2 - t)
            key = "native" if native else "torch"
            row[f"{key}_issue_s"] = statistics.median(issue)
            row[f"{key}_gbps"] = count * size / statistics.median(total) / 1e9
        assert torch.equal(dst[:size].cpu(), src[:size])
        out[name] = row
    return out


async def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    cuda = args.device.lower().startswith("cuda")
    r: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if cuda else f"CPU ({platform.processor() or platform.machine()})",
        "model": "SmolLM2-135M-Instruct's tokenizer" + (", random weights" if args.skeleton else ""),
        "versions": {"torch": torch.__version__, "python": platform.python_version()},
    }
    work = Path(tempfile.mkdtemp(prefix="gpu_arena."))
    r["models"] = {}
    try:
        for shape in args.shapes.split(","):
            m: dict[str, Any] = {}
            log(f"{shape}: write its checkpoint")
            t = time.perf_counter()
            artifact, tensors = checkpoint(work, args.skeleton, "cuda" if cuda else "cpu", shape)
            m["checkpoint_s"] = time.perf_counter() - t
            log(f"{shape}: an arena per worker")
            m["own_arena"] = await scenario(False, args, artifact, tensors)
            log(f"{shape}: the node's arena")
            m["node_arena"] = await scenario(True, args, artifact, tensors)
            own, node = m["own_arena"]["restart"], m["node_arena"]["restart"]
            m["restart_speedup"] = own["start_to_first_token_s"] / node["start_to_first_token_s"]
            m["restart_start_speedup"] = own["start_s"] / node["start_s"]
            log(f"{shape}: streaming")
            m["streaming"] = await streaming(args, artifact, tensors)
            r["models"][shape] = m
            shutil.rmtree(work / shape, ignore_errors=True)
        if cuda:
            log("copies")
            r["copies"] = copies(args)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return r


def plot(r: dict[str, Any], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    shapes = list(r["models"])
    panels = len(shapes) + ("copies" in r)
    fig, axes = plt.subplots(1, panels, figsize=(6 * panels, 4.5), squeeze=False)
    for i, shape in enumerate(shapes):
        m = r["models"][shape]
        ax = axes[0][i]
        labels, values, colors = [], [], []
        for key, name, color in (("own_arena", "arena per worker", "#999"), ("node_arena", "node's arena", "#27a")):
            for when in ("first", "restart"):
                labels.append(f"{name}\n{when}")
                values.append(m[key][when]["start_to_first_token_s"])
                colors.append(color)
        ax.bar(labels, values, color=colors)
        ax.set_ylabel("start → first token (s)")
        ax.set_title(f"{shape}, {r['device']}\nrestart on a new worker: {m['restart_speedup']:.1f}x")
        ax.tick_params(axis="x", labelsize=8)
    if "copies" in r:
        ax = axes[0][-1]
        rows = r["copies"]
        names = list(rows)
        x = range(len(names))
        ax.bar([i - 0.2 for i in x], [rows[n]["torch_gbps"] for n in names], 0.4, label="torch copy_ per chunk")
        ax.bar([i + 0.2 for i in x], [rows[n]["native_gbps"] for n in names], 0.4, label="extension, one call")
        ax.set_xticks(list(x), [f"{rows[n]['spans']} × {rows[n]['span_bytes'] >> 10} KiB" for n in names])
        ax.set_ylabel("GB/s host → device")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--device", default=None, help="CUDA or CPU (default: CUDA where present)")
    ap.add_argument("--skeleton", default=None, help="a config + tokenizer directory: random weights of it")
    ap.add_argument("--arena-bytes", type=int, default=None, help="default: 2 GiB, 20 GiB with llama3-8b")
    ap.add_argument("--threads", type=int, default=min(8, os.cpu_count() or 1))
    ap.add_argument("--restarts", type=int, default=2)
    ap.add_argument("--shapes", default="smol", help="smol, llama3-8b (needs --skeleton), comma-separated")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "gpu_arena.json"))
    args = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    if args.arena_bytes is None:
        args.arena_bytes = (20 << 30) if "llama3-8b" in args.shapes else (2 << 30)
    if "llama3-8b" in args.shapes and not args.skeleton:
        ap.error("llama3-8b needs --skeleton (its tokenizer)")
    if args.device is None:
        import torch

        args.device = "CUDA" if torch.cuda.is_available() else "CPU"
    if args.device.lower().startswith("cuda"):
        from cuda_ext.build import ensure

        ensure()  # the node's arena on CUDA is the extension's allocation
    r = asyncio.run(run(args))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(r, indent=2) + "\n")
    try:
        plot(r, out.with_suffix(".png"))
    except Exception as e:  # the figures are in the JSON already
        r["plot_error"] = repr(e)
        out.write_text(json.dumps(r, indent=2) + "\n")
    print(json.dumps(r, indent=2))


if __name__ == "__main__":
    main()

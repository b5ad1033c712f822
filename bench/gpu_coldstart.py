"""GPU cold-start benchmark (issue 20): a naive start against Tessera's arena, reuse and pre-warmed worker.

    python3 -m bench.gpu_coldstart [--budget-s 330] [--out bench/results/gpu_coldstart.json]
    python3 -m bench.gpu_coldstart --smoke      # the host, a tiny model, no 8B and no graphs: < 1 min

No checkpoint can travel to the GPU machine, so the run builds the default model's architecture
(SmolLM2-135M-Instruct: Llama, hidden 576, 30 layers, 9 heads, 3 KV heads, tied embeddings) with
random weights on the device and saves it as safetensors and a config in a temporary directory:
the checkpoint on local disk. Random weights cost the same to move and to run. It measures:

- `naive_cold_ttft_s`: a fresh Python process imports torch and transformers, loads the
  checkpoint onto the device and computes the first token of a 16-token prompt; from the
  parent's spawn, the best of `--naive-runs`, with its phases.
- `tessera_gpu_cold_miss_ttft_s`: a pre-warmed worker (TIDAL §5: torch, transformers, CUDA
  context, cuBLAS and attention kernels initialized; the arena allocated; the model's host cache
  filled, pinned and packed in access order, its digests and access order taken at
  registration) is bound to the model: the arena copies every tensor on several streams
  (`cuda_ext`), `policy.prefetch` (TIDAL Eq. 1 with the measured bandwidth) says how much must
  be in before the first forward pass, and the rest streams behind it, each layer waited for on
  the device; the skeleton is built on the meta device while the copy runs. From the parent's
  command to the first token (the pipe's round trip included).
- `tessera_gpu_cold_hit_ttft_s`: the model was scaled to zero (released, not evicted), so its
  tensors are found resident by content hash and nothing is copied.
- `h2d_gbps`: a plain pinned host-to-device copy of 1 GiB, the median of five.
- `load_8b_s`, `hit_8b_ttft_s`: an 8B-shaped Llama (Llama-3-8B's architecture, random bf16
  weights made on the device into a pinned host image): host memory → arena, and a start with
  the weights resident → first token; against bytes / `h2d_gbps`.
- `graph_capture_s`, `graph_restore_s`: decode compiled with `torch.compile(mode=
  "reduce-overhead")` (CUDA graphs) over a static KV cache, in a fresh process with empty
  compiler caches (until three decode steps are done), then in another fresh process after
  `torch.compiler.load_cache_artifacts` of what the first saved (MEDUSA §4–6: materialized at
  registration, restored at start). A start serves its first token eagerly and restores graphs
  behind it, so `graph_restore_s` is not in the cold-start phases.
- `decode_tok_s` / `decode_tok_s_plain`: greedy decode (transformers' `generate`) with the
  arena-backed weights and with the same model loaded the usual way, interleaved, medians.

Each part has a time budget; a part that fails or runs out is an error in the JSON and the
rest goes on; the JSON is written after every part. Prints the JSON; writes it to `--out` and a
plot next to it where matplotlib is importable.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
MARK = "@@gpu_coldstart "

# SmolLM2-135M-Instruct's config.json (the default model), less what a random-weight run needs not.
SMOL: dict[str, Any] = {
    "hidden_size": 576,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "intermediate_size": 1536,
    "vocab_size": 49152,
    "tie_word_embeddings": True,
    "rope_theta": 100000.0,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
# Meta-Llama-3-8B's architecture.
LLAMA3_8B: dict[str, Any] = {
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "intermediate_size": 14336,
    "vocab_size": 128256,
    "tie_word_embeddings": False,
    "rope_theta": 500000.0,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
}
# The smoke run's model, and the shape the pre-warmed worker runs once to load its kernels.
TINY: dict[str, Any] = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "vocab_size": 512,
    "tie_word_embeddings": True,
    "rope_theta": 100000.0,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
PROMPT_TOKENS = 16
GRAPH_STEPS = 8


def access_order(model: Any, *inputs: Any) -> list[str]:
    """The parameter names in the order one forward pass first reads them (TIDAL reorders its
    templates' weights the same way): the order the host image is packed in."""
    import torch

    order: dict[str, None] = {}
    handles: list[Any] = []
    params_of: dict[int, str] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        params_of.setdefault(id(p), n)  # a tied weight goes by its first name, as checkpoints save it
    for module in model.modules():
        own = list(module.parameters(recurse=False))
        if own:

            def hook(_m: Any, _args: object, own: list[Any] = own) -> None:
                for p in own:
                    order.setdefault(params_of[id(p)], None)

            handles.append(module.register_forward_pre_hook(hook))
    try:
        with torch.inference_mode():
            model(*inputs)
    finally:
        for handle in handles:
            handle.remove()
    # Parameters no forward read (none in a causal LM) still need a place: last.
    return [*order, *(n for n in params_of.values() if n not in order)]


def first_token(model: Any, input_ids: Any) -> int:
    """One forward pass over the prompt, the greedy next token (its `.item()` waits for it)."""
    import torch

    with torch.inference_mode():
        logits = model(input_ids=input_ids).logits
    return int(logits[0, -1].argmax().item())


def prompt_ids(vocab: int) -> list[int]:
    """A fixed 16-token prompt (no tokenizer travels with a random-weight model)."""
    return [(7919 * i) % vocab for i in range(1, PROMPT_TOKENS + 1)]


def emit(obj: dict[str, Any]) -> None:
    print(MARK + json.dumps(obj), flush=True)


def _sync(torch: Any, device: Any) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _load_plain(ckpt: str, dtype: Any, device: Any) -> Any:
    """The usual transformers load onto the device (straight there where it can, else via the host)."""
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=dtype, device_map=str(device))
    except (ImportError, ValueError):  # device_map wants accelerate in some versions
        model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=dtype).to(device)
    return model.eval()


# The naive start: a fresh process.


def child_naive(args: argparse.Namespace) -> None:
    t_main = time.time()
    import torch

    t_torch = time.time()
    import transformers  # noqa: F401

    t_transformers = time.time()
    device = torch.device(args.device)
    torch.empty(1, device=device)
    _sync(torch, device)
    t_cuda = time.time()
    model = _load_plain(args.ckpt, getattr(torch, args.dtype), device)
    _sync(torch, device)
    t_load = time.time()
    ids = torch.tensor([prompt_ids(model.config.vocab_size)], device=device)
    with torch.inference_mode():
        token = int(model(input_ids=ids).logits[0, -1].argmax().item())
    t_first = time.time()
    emit(
        {
            "t_main": t_main,
            "t_torch": t_torch,
            "t_transformers": t_transformers,
            "t_device": t_cuda,
            "t_load": t_load,
            "t_first": t_first,
            "token": token,
        }
    )


# Tessera's pre-warmed worker.


class Worker:
    """A pre-warmed engine worker: everything a start needs but the model (TIDAL §5)."""

    def __init__(self, args: argparse.Namespace) -> None:
        t0 = time.perf_counter()
        sys.path.insert(0, str(ROOT))
        import torch
        from transformers import AutoModelForCausalLM, LlamaConfig

        from cuda_ext import TensorArena
        from services.engine.torch_engine import binding

        self.torch = torch
        self.binding = binding
        self.device = torch.device(args.device)
        self.dtype = getattr(torch, args.dtype)
        self.arena = TensorArena(args.arena_bytes, self.device)
        self.h2d_bps = 0.0
        self.bound: Any = None
        self.plain: Any = None
        # Kernels: one forward and a few decode steps of a tiny Llama in the serving dtype load
        # cuBLAS, its workspace and the attention kernels before any model is bound.
        with torch.device(self.device):
            tiny = AutoModelForCausalLM.from_config(LlamaConfig(**TINY), dtype=self.dtype).eval()
        ids = torch.tensor([prompt_ids(TINY["vocab_size"])], device=self.device)
        tiny.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=0)
        del tiny
        _sync(torch, self.device)
        self.prewarm_s = time.perf_counter() - t0

    def h2d(self, nbytes: int, reps: int) -> dict[str, Any]:
        torch = self.torch
        cuda = self.device.type == "cuda"
        src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
        src.fill_(1)
        dst = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        rates = []
        for _ in range(reps):
            _sync(torch, self.device)
            t = time.perf_counter()
            dst.copy_(src, non_blocking=cuda)
            _sync(torch, self.device)
            rates.append(nbytes / (time.perf_counter() - t) / 1e9)
        del src, dst
        gbps = statistics.median(rates)
        self.h2d_bps = gbps * 1e9
        return {"h2d_gbps": gbps, "h2d_gbps_max": max(rates), "runs_gbps": rates, "bytes": nbytes}

    def prepare(self, ckpt: str) -> dict[str, Any]:
        """Registration and the host cache: digests, access order (traced on a bound model), warm
        TTFT (for Eq. 1), then the pinned image packed in access order; the arena left empty."""
        from safetensors.torch import load_file
        from transformers import AutoConfig

        from cuda_ext import HostImage, content_digests

        torch, binding = self.torch, self.binding
        t0 = time.perf_counter()
        self.ckpt = ckpt
        self.config = AutoConfig.from_pretrained(ckpt)
        tensors = load_file(str(Path(ckpt) / "model.safetensors"))
        digests = content_digests(tensors, threads=os.cpu_count() or 1)
        self.ids = torch.tensor([prompt_ids(self.config.vocab_size)], device=self.device)
        staging = HostImage.of(tensors, digests, pin=False)
        loaded = self.arena.load([staging.specs], staging)
        loaded.synchronize()
        bound = binding.bind(binding.skeleton(self.config, self.dtype), loaded, self.device)
        order = [n for n in access_order(bound.model, self.ids) if n in tensors]
        order += [n for n in tensors if n not in order]
        first_token(bound.model, self.ids)
        t = time.perf_counter()
        first_token(bound.model, self.ids)
        self.warm_ttft_s = time.perf_counter() - t
        del bound
        self.arena.release(loaded)
        for resident in self.arena.idle():
            self.arena.evict(resident.digest)
        del staging
        self.image = HostImage.of({n: tensors[n] for n in order}, digests)
        self.units = binding.units_in_order(order)
        return {
            "prepare_s": time.perf_counter() - t0,
            "model_bytes": self.image.nbytes,
            "tensors": len(order),
            "units": len(self.units),
            "warm_ttft_s": self.warm_ttft_s,
            "pinned": self.image.pinned,
        }

    def start(self) -> dict[str, Any]:
        """A cold start of the prepared model: copy what is not resident, bind, first token."""
        from policy.prefetch import Layer, plan_prefetch

        binding = self.binding
        t0 = time.perf_counter()
        spec = {s.name: s for s in self.image.specs}
        groups = [[spec[n] for n in names] for _, names in self.units]
        layers = [Layer(u, sum(spec[n].nbytes for n in names)) for u, names in self.units]
        plan = plan_prefetch(layers, self.warm_ttft_s, self.h2d_bps or 1.0)
        loaded = self.arena.load(groups, self.image)
        t1 = time.perf_counter()
        model = binding.skeleton(self.config, self.dtype)
        bound = binding.bind(model, loaded, self.device, [u for u, _ in self.units])
        t2 = time.perf_counter()
        for g in range(len(plan.before_admit)):
            for event in loaded.waits[g]:
                event.synchronize()
        t3 = time.perf_counter()
        token = first_token(model, self.ids)
        t4 = time.perf_counter()
        bound.stop_waiting()
        self.bound = bound
        return {
            "ttft_in_worker_s": t4 - t0,
            "token": token,
            "copied_bytes": loaded.copied_bytes,
            "reused_bytes": loaded.reused_bytes,
            "transfers": loaded.transfers,
            "phases": {
                "cuda_init_s": 0.0,
                "weight_copy_s": (t1 - t0) + (t3 - t2),
                "worker_bind_s": t2 - t1,
                "graph_restore_s": 0.0,
                "first_token_s": t4 - t3,
            },
            "prefetch": {
                "target_bytes": plan.target_bytes,
                "before_admit_units": len(plan.before_admit),
                "streamed_units": len(plan.streamed),
                "streamed_bytes": plan.streamed_bytes,
            },
        }

    def release(self) -> dict[str, Any]:
        """Scale to zero: the model goes, its tensors stay resident (idle) in the arena."""
        self.arena.release(self.bound.loaded)
        self.bound = None
        _sync(self.torch, self.device)
        return {"idle_bytes": sum(r.nbytes for r in self.arena.idle())}

    def decode(self, tokens: int, reps: int) -> dict[str, Any]:
        """Greedy decode tok/s, arena-backed against the same checkpoint loaded the usual way,
        interleaved so that drift hits both alike."""
        torch = self.torch
        plain = _load_plain(self.ckpt, self.dtype, self.device)
        models = {"arena": self.bound.model, "plain": plain}
        rates: dict[str, list[float]] = {"arena": [], "plain": []}
        # Warm-up at the measured length: a first 64-token generate ran at a quarter of the
        # later ones' rate (seen on the H200: 14 then 50-57 tok/s), whichever model went first.
        for model in models.values():
            model.generate(self.ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, pad_token_id=0)
        for _ in range(reps):
            for name, model in models.items():
                _sync(torch, self.device)
                t = time.perf_counter()
                out = model.generate(
                    self.ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, pad_token_id=0
                )
                _sync(torch, self.device)
                rates[name].append((out.shape[1] - self.ids.shape[1]) / (time.perf_counter() - t))
        same = bool(
            torch.equal(
                models["arena"].generate(self.ids, max_new_tokens=8, do_sample=False, pad_token_id=0),
                plain.generate(self.ids, max_new_tokens=8, do_sample=False, pad_token_id=0),
            )
        )
        del plain, models
        return {
            "decode_tok_s": statistics.median(rates["arena"]),
            "decode_tok_s_plain": statistics.median(rates["plain"]),
            "runs": rates,
            "tokens": tokens,
            "same_tokens": same,
        }

    def big(self) -> dict[str, Any]:
        """The 8B-shaped model: a pinned host image made on the device, host → arena, then a hit."""
        from transformers import LlamaConfig

        from cuda_ext import HostImage, TensorSpec
        from cuda_ext.copies import byte_view

        torch, binding = self.torch, self.binding
        config = LlamaConfig(**LLAMA3_8B)
        meta = binding.skeleton(config, torch.bfloat16)
        params = list(meta.named_parameters())  # a Llama's parameters are declared in access order
        del meta
        t0 = time.perf_counter()
        image = HostImage([TensorSpec(n, "", torch.bfloat16, tuple(p.shape)) for n, p in params], pin=True)
        t1 = time.perf_counter()
        gen = torch.Generator(device=self.device).manual_seed(0)
        for name, p in params:
            if name.endswith("norm.weight"):
                t = torch.ones(p.shape, dtype=torch.bfloat16, device=self.device)
            else:
                t = torch.randn(p.shape, dtype=torch.bfloat16, device=self.device, generator=gen).mul_(0.02)
            image.bytes_of(name).copy_(byte_view(t))
        _sync(torch, self.device)
        t2 = time.perf_counter()
        image.digest_contents(threads=os.cpu_count() or 1)
        t3 = time.perf_counter()
        units = binding.units_in_order([n for n, _ in params])
        ids = torch.tensor([prompt_ids(config.vocab_size)], device=self.device)

        # Miss: everything from host memory (one group: the copy alone, then bind and a token).
        s0 = time.perf_counter()
        loaded = self.arena.load([image.specs], image)
        loaded.synchronize()
        s1 = time.perf_counter()
        model = binding.skeleton(config, torch.bfloat16)
        binding.bind(model, loaded, self.device)
        s2 = time.perf_counter()
        first_token(model, ids)
        s3 = time.perf_counter()
        del model
        self.arena.release(loaded)

        # Hit: scaled to zero, resident; a new start binds the views and computes.
        h0 = time.perf_counter()
        again = self.arena.load([image.specs], image)
        model = binding.skeleton(config, torch.bfloat16)
        binding.bind(model, again, self.device)
        h1 = time.perf_counter()
        first_token(model, ids)
        h2 = time.perf_counter()
        del model
        self.arena.release(again)
        mine = set(loaded.digests)
        for resident in self.arena.idle():
            if resident.digest in mine:
                self.arena.evict(resident.digest)
        copied = loaded.copied_bytes
        del image
        _sync(torch, self.device)
        return {
            "model_bytes": sum(
                s.nbytes for s in (TensorSpec(n, "", torch.bfloat16, tuple(p.shape)) for n, p in params)
            ),
            "copied_bytes": copied,
            "transfers": loaded.transfers,
            "units": len(units),
            "pin_alloc_s": t1 - t0,
            "generate_s": t2 - t1,
            "digest_s": t3 - t2,
            "load_8b_s": s1 - s0,
            "miss_8b_bind_s": s2 - s1,
            "miss_8b_first_token_s": s3 - s2,
            "miss_8b_ttft_s": s3 - s0,
            "hit_8b_bind_s": h1 - h0,
            "hit_8b_first_token_s": h2 - h1,
            "hit_8b_ttft_s": h2 - h0,
            "hit_8b_copied_bytes": again.copied_bytes,
        }


def child_worker(args: argparse.Namespace) -> None:
    worker = Worker(args)
    emit({"ok": True, "prewarm_s": worker.prewarm_s})
    for line in sys.stdin:
        cmd = json.loads(line)
        try:
            result = getattr(worker, cmd.pop("op"))(**cmd)
            emit({"ok": True, **result})
        except Exception as e:
            emit({"ok": False, "error": repr(e), "traceback": traceback.format_exc()[-3000:]})


# Graphs: capture, save, restore.


def child_graphs(args: argparse.Namespace) -> None:
    import torch
    from transformers import StaticCache

    device = torch.device(args.device)
    model = _load_plain(args.ckpt, getattr(torch, args.dtype), device)
    ids = torch.tensor([prompt_ids(model.config.vocab_size)], device=device)
    # A pre-warmed worker has the compiler imported already (TIDAL §5): its import is not what
    # capture and restore differ in, so both processes pay it before the clock.
    t_import = time.perf_counter()
    import torch._dynamo
    import torch._inductor.compile_fx

    compiler_import_s = time.perf_counter() - t_import
    _sync(torch, device)
    t0 = time.perf_counter()
    artifact_bytes = 0
    if args.restore:
        data = Path(args.artifacts).read_bytes()
        artifact_bytes = len(data)
        torch.compiler.load_cache_artifacts(data)
    t_loaded = time.perf_counter()
    cache = StaticCache(config=model.config, max_cache_len=PROMPT_TOKENS + GRAPH_STEPS + 8)
    with torch.no_grad():
        logits = model(
            input_ids=ids,
            past_key_values=cache,
            cache_position=torch.arange(PROMPT_TOKENS, device=device),
            use_cache=True,
        ).logits
        token = logits[:, -1:].argmax(-1)

        def step(token: Any, position: Any) -> Any:
            return model(input_ids=token, past_key_values=cache, cache_position=position, use_cache=True).logits

        compiled = (
            torch.compile(step, backend=args.backend) if args.backend else torch.compile(step, mode="reduce-overhead")
        )
        _sync(torch, device)
        t_prefill = time.perf_counter()
        steps = []
        for i in range(GRAPH_STEPS):
            t = time.perf_counter()
            logits = compiled(token, torch.tensor([PROMPT_TOKENS + i], device=device))
            token = logits[:, -1:].argmax(-1).clone()
            _sync(torch, device)
            steps.append(time.perf_counter() - t)
    # Ready once three steps are done: cudagraph trees warm up, record, then replay.
    ready_s = (t_loaded - t0) + sum(steps[:3])
    out: dict[str, Any] = {
        "ready_s": ready_s,
        "artifact_load_s": t_loaded - t0,
        "prefill_s": t_prefill - t_loaded,
        "steps_s": steps,
        "steady_step_s": statistics.median(steps[3:]),
        "artifact_bytes": artifact_bytes,
        "compiler_import_s": compiler_import_s,
    }
    from torch._dynamo.utils import counters

    # Whether the restore hit the saved graphs (fxgraph_cache_hit) or compiled them again.
    out["compiler_counters"] = {k: dict(v) for k, v in counters.items() if k in ("inductor", "aot_autograd")}
    if not args.restore:
        saved = torch.compiler.save_cache_artifacts()
        data = saved[0] if saved is not None else b""
        if not data and not args.backend:  # only a backend without a compiler (eager) saves nothing
            raise RuntimeError("the compiler saved no cache artifacts")
        Path(args.artifacts).write_bytes(data)
        out["artifact_bytes"] = len(data)
    emit(out)


# The parent: builds the checkpoint, runs the parts, writes the results.


def _child_cmd(*extra: str) -> list[str]:
    return [sys.executable, "-m", "bench.gpu_coldstart", *extra]


def _marked(text: str) -> dict[str, Any]:
    lines = [line for line in text.splitlines() if line.startswith(MARK)]
    if not lines:
        raise RuntimeError(f"no result; output ends: {text[-2000:]}")
    result: dict[str, Any] = json.loads(lines[-1][len(MARK) :])
    return result


class Channel:
    """The worker process, spoken to by JSON lines with a deadline on every answer."""

    def __init__(self, cmd: list[str], env: dict[str, str], log: Path) -> None:
        self.log = log.open("w")
        self.proc = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True
        )
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(MARK):
                self.lines.put(line[len(MARK) :])
        self.lines.put("")

    def answer(self, timeout_s: float) -> dict[str, Any]:
        try:
            line = self.lines.get(timeout=max(timeout_s, 0.1))
        except queue.Empty:
            raise TimeoutError(f"no answer in {timeout_s:.0f} s") from None
        if not line:
            raise RuntimeError(f"the worker exited ({self.proc.poll()})")
        result: dict[str, Any] = json.loads(line)
        if not result.get("ok"):
            raise RuntimeError(f"{result.get('error')}\n{result.get('traceback', '')}")
        return result

    def ask(self, timeout_s: float, op: str, **kwargs: Any) -> tuple[dict[str, Any], float]:
        """Send a command; its answer and the seconds from sending to answer."""
        assert self.proc.stdin is not None
        t = time.perf_counter()
        self.proc.stdin.write(json.dumps({"op": op, **kwargs}) + "\n")
        self.proc.stdin.flush()
        result = self.answer(timeout_s)
        return result, time.perf_counter() - t

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.t0 = time.monotonic()
        self.out = Path(args.out)
        self.results: dict[str, Any] = {
            "mode": "smoke" if args.smoke else "gpu",
            "device": None,
            "naive_cold_ttft_s": None,
            "tessera_gpu_cold_hit_ttft_s": None,
            "tessera_gpu_cold_miss_ttft_s": None,
            "phases": {},
            "h2d_gbps": None,
            "load_8b_s": None,
            "hit_8b_ttft_s": None,
            "graph_capture_s": None,
            "graph_restore_s": None,
            "decode_tok_s": None,
            "decode_tok_s_plain": None,
            "targets": {},
            "details": {},
            "errors": {},
            "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }

    def left(self) -> float:
        return self.args.budget_s - (time.monotonic() - self.t0)

    def write(self) -> None:
        self.results["elapsed_s"] = round(time.monotonic() - self.t0, 2)
        self.out.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.out.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.results, indent=2) + "\n")
        tmp.replace(self.out)

    def part(self, name: str, needs_s: float, fn: Callable[[], None]) -> bool:
        """Run one part unless fewer than `needs_s` seconds of the budget are left; a failure is
        recorded and the run goes on."""
        if self.left() < needs_s:
            self.results["errors"][name] = f"skipped: {self.left():.0f} s of the budget left, {needs_s:.0f} s needed"
            self.write()
            return False
        t = time.monotonic()
        try:
            fn()
            ok = True
        except Exception as e:
            self.results["errors"][name] = f"{e!r}\n{traceback.format_exc()[-3000:]}"
            ok = False
        self.results["details"].setdefault("part_s", {})[name] = round(time.monotonic() - t, 2)
        self.write()
        return ok

    def run(self) -> dict[str, Any]:
        args = self.args
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM

        cuda = torch.cuda.is_available() and not args.smoke
        device = torch.device("cuda") if cuda else torch.device("cpu")
        dtype = "bfloat16" if cuda else "float32"
        self.results["device"] = torch.cuda.get_device_name(device) if cuda else "cpu (host fallback)"
        self.results["details"]["versions"] = {"torch": torch.__version__, "python": sys.version.split()[0]}
        work = Path(tempfile.mkdtemp(prefix="gpu_coldstart."))
        ckpt = work / "ckpt"
        arch = TINY if args.smoke else SMOL
        # Offline: every path is local, and the GPU machine reaches no hub (a lookup would wait on it).
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}
        common = ["--device", str(device), "--dtype", dtype]

        def build() -> None:
            import transformers

            t = time.perf_counter()
            self.results["details"]["versions"]["transformers"] = transformers.__version__
            torch.manual_seed(0)
            with torch.device(device):
                model = LlamaForCausalLM(LlamaConfig(**arch)).to(getattr(torch, dtype))
            model.save_pretrained(ckpt)
            params = sum(p.numel() for p in model.parameters())
            del model
            if cuda:
                torch.cuda.empty_cache()
            self.results["details"]["model"] = {
                "architecture": "SmolLM2-135M-Instruct (random weights)" if not args.smoke else "tiny Llama",
                "params": params,
                "dtype": dtype,
                "checkpoint_bytes": sum(f.stat().st_size for f in ckpt.iterdir()),
                "build_s": time.perf_counter() - t,
            }

        def naive() -> None:
            runs = []
            for _ in range(args.naive_runs):
                spawn = time.time()
                proc = subprocess.run(
                    _child_cmd("--child", "naive", "--ckpt", str(ckpt), *common),
                    cwd=ROOT,
                    env=env,
                    capture_output=True,
                    text=True,
                    timeout=max(self.left() - 5, 10),
                )
                r = _marked(proc.stdout + proc.stderr)
                runs.append(
                    {
                        "ttft_s": r["t_first"] - spawn,
                        "interpreter_s": r["t_main"] - spawn,
                        "import_torch_s": r["t_torch"] - r["t_main"],
                        "import_transformers_s": r["t_transformers"] - r["t_torch"],
                        "cuda_init_s": r["t_device"] - r["t_transformers"],
                        "weight_load_s": r["t_load"] - r["t_device"],
                        "first_token_s": r["t_first"] - r["t_load"],
                    }
                )
            best = min(runs, key=lambda r: r["ttft_s"])
            self.results["naive_cold_ttft_s"] = best["ttft_s"]
            self.results["phases"]["naive"] = best
            self.results["details"]["naive_runs"] = runs

        channel: list[Channel] = []

        def start_worker() -> None:
            arena_bytes = (20 << 30) if cuda else (64 << 20)
            ch = Channel(
                _child_cmd("--child", "worker", "--arena-bytes", str(arena_bytes), *common), env, work / "worker.log"
            )
            channel.append(ch)
            ready = ch.answer(timeout_s=max(min(self.left() - 5, 120), 10))
            self.results["details"]["worker_prewarm_s"] = ready["prewarm_s"]

        def h2d() -> None:
            r, _ = channel[0].ask(60, "h2d", nbytes=(1 << 30) if cuda else (64 << 20), reps=5)
            self.results["h2d_gbps"] = r["h2d_gbps"]
            self.results["details"]["h2d"] = {k: v for k, v in r.items() if k != "ok"}

        def prepare() -> None:
            r, _ = channel[0].ask(max(min(self.left() - 5, 120), 10), "prepare", ckpt=str(ckpt))
            self.results["details"]["registration"] = {k: v for k, v in r.items() if k != "ok"}

        def start(kind: str) -> Callable[[], None]:
            def go() -> None:
                r, wall = channel[0].ask(60, "start")
                r.pop("ok")
                phases = r.pop("phases")
                phases["ipc_s"] = wall - r["ttft_in_worker_s"]
                self.results[f"tessera_gpu_cold_{kind}_ttft_s"] = wall
                self.results["phases"][f"tessera_{kind}"] = phases
                self.results["details"][f"start_{kind}"] = r

            return go

        def release() -> None:
            r, _ = channel[0].ask(30, "release")
            self.results["details"]["scaled_to_zero"] = {k: v for k, v in r.items() if k != "ok"}

        def decode() -> None:
            r, _ = channel[0].ask(
                max(min(self.left() - 5, 90), 10), "decode", tokens=64 if cuda else 16, reps=5 if cuda else 2
            )
            self.results["decode_tok_s"] = r["decode_tok_s"]
            self.results["decode_tok_s_plain"] = r["decode_tok_s_plain"]
            self.results["details"]["decode"] = {k: v for k, v in r.items() if k != "ok"}

        def big() -> None:
            r, _ = channel[0].ask(max(min(self.left() - 5, 150), 10), "big")
            r.pop("ok")
            self.results["load_8b_s"] = r["load_8b_s"]
            self.results["hit_8b_ttft_s"] = r["hit_8b_ttft_s"]
            if self.results["h2d_gbps"]:
                ideal = r["copied_bytes"] / (self.results["h2d_gbps"] * 1e9)
                r["ideal_load_s"] = ideal
                r["fraction_of_h2d"] = ideal / r["load_8b_s"]
            self.results["details"]["model_8b"] = r

        def graphs() -> None:
            artifacts = work / "artifacts.bin"
            backend = ["--backend", args.graph_backend] if args.graph_backend else []
            for mode in ("capture", "restore"):
                # Empty compiler caches in each process: what a new node has, so the restore
                # reads the saved artifacts and nothing else.
                cache = work / f"inductor-{mode}"
                genv = {**env, "TORCHINDUCTOR_CACHE_DIR": str(cache), "TRITON_CACHE_DIR": str(cache / "triton")}
                extra = ["--restore"] if mode == "restore" else []
                proc = subprocess.run(
                    _child_cmd(
                        "--child",
                        "graphs",
                        "--ckpt",
                        str(ckpt),
                        "--artifacts",
                        str(artifacts),
                        *common,
                        *backend,
                        *extra,
                    ),
                    cwd=ROOT,
                    env=genv,
                    capture_output=True,
                    text=True,
                    timeout=max(self.left() - 3, 10),
                )
                r = _marked(proc.stdout + proc.stderr)
                self.results[f"graph_{mode}_s"] = r["ready_s"]
                self.results["details"][f"graph_{mode}"] = r
                self.write()

        self.part("checkpoint", 10, build)
        self.part("naive", 20, naive)
        if self.part("worker_prewarm", 20, start_worker):
            self.part("h2d", 10, h2d)
            if self.part("registration", 15, prepare):
                if self.part("start_miss", 10, start("miss")):
                    self.part("scale_to_zero", 5, release)
                    if self.part("start_hit", 10, start("hit")):
                        self.part("decode", 20, decode)
            if args.smoke:
                self.results["errors"]["model_8b"] = "skipped: smoke run"
            else:
                self.part("model_8b", 60, big)
        for ch in channel:
            ch.close()
            self.results["details"]["worker_log_tail"] = (work / "worker.log").read_text()[-1500:]
        if args.smoke and not args.graph_backend:
            self.results["errors"]["graphs"] = "skipped: smoke run"
        else:
            self.part("graphs", 60, graphs)
        self.results["targets"] = targets(self.results)
        self.write()
        shutil.rmtree(work, ignore_errors=True)
        try:
            plot(self.results, self.out.with_suffix(".png"))
        except Exception as e:  # the figures are in the JSON already
            self.results["errors"]["plot"] = repr(e)
            self.write()
        return self.results


def targets(r: dict[str, Any]) -> dict[str, Any]:
    """The issue's targets, each with its value, its bound and whether it is met (None: not measured)."""

    def check(value: float | None, bound: float | None, le: bool = True) -> dict[str, Any]:
        if value is None or bound is None:
            return {"value": value, "bound": bound, "met": None}
        return {"value": round(value, 4), "bound": round(bound, 4), "met": value <= bound if le else value >= bound}

    naive = r["naive_cold_ttft_s"]
    fraction = r["details"].get("model_8b", {}).get("fraction_of_h2d")
    capture, restore = r["graph_capture_s"], r["graph_restore_s"]
    dec, plain = r["decode_tok_s"], r["decode_tok_s_plain"]
    return {
        "hit_le_tenth_of_naive_s": check(r["tessera_gpu_cold_hit_ttft_s"], naive / 10 if naive else None),
        "miss_le_third_of_naive_s": check(r["tessera_gpu_cold_miss_ttft_s"], naive / 3 if naive else None),
        "hit_8b_ttft_le_s": check(r["hit_8b_ttft_s"], 0.3),
        "load_8b_fraction_of_h2d_ge": check(fraction, 0.7, le=False),
        "restore_speedup_ge": check(capture / restore if capture and restore else None, 3.0, le=False),
        "decode_ratio_to_plain_ge": check(dec / plain if dec and plain else None, 0.9, le=False),
    }


def plot(r: dict[str, Any], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    bars = [
        ("naive", r["naive_cold_ttft_s"]),
        ("Tessera miss", r["tessera_gpu_cold_miss_ttft_s"]),
        ("Tessera hit", r["tessera_gpu_cold_hit_ttft_s"]),
    ]
    names = [n for n, v in bars if v]
    axes[0].bar(names, [v for _, v in bars if v], color=["#999", "#4a7", "#27a"][: len(names)])
    axes[0].set_yscale("log")
    axes[0].set_ylabel("cold-start TTFT (s, log)")
    axes[0].set_title(f"SmolLM2-135M shape, {r['device']}")
    big = r["details"].get("model_8b", {})
    eight = [("copy (ideal)", big.get("ideal_load_s")), ("copy", r["load_8b_s"]), ("hit TTFT", r["hit_8b_ttft_s"])]
    axes[1].bar([n for n, v in eight if v], [v for _, v in eight if v], color="#a74")
    axes[1].set_ylabel("s")
    axes[1].set_title("8B-shaped Llama: host → arena, resident hit")
    graph = [("capture", r["graph_capture_s"]), ("restore", r["graph_restore_s"])]
    axes[2].bar([n for n, v in graph if v], [v for _, v in graph if v], color="#75a")
    axes[2].set_ylabel("s until three decode steps ran")
    axes[2].set_title("decode CUDA graphs: capture vs restore")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--smoke", action="store_true", help="the host, a tiny model, no 8B part and no graphs")
    ap.add_argument("--out", default=None, help="the JSON's path (the plot goes beside it)")
    ap.add_argument("--budget-s", type=float, default=330.0, help="the whole run's time budget")
    ap.add_argument("--naive-runs", type=int, default=2)
    ap.add_argument("--graph-backend", default=None, help="a torch.compile backend instead of reduce-overhead")
    ap.add_argument("--child", choices=["naive", "worker", "graphs"], default=None, help=argparse.SUPPRESS)
    ap.add_argument("--ckpt", help=argparse.SUPPRESS)
    ap.add_argument("--device", default="cpu", help=argparse.SUPPRESS)
    ap.add_argument("--dtype", default="float32", help=argparse.SUPPRESS)
    ap.add_argument("--arena-bytes", type=int, default=64 << 20, help=argparse.SUPPRESS)
    ap.add_argument("--artifacts", help=argparse.SUPPRESS)
    ap.add_argument("--restore", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--backend", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child == "naive":
        child_naive(args)
    elif args.child == "worker":
        child_worker(args)
    elif args.child == "graphs":
        child_graphs(args)
    else:
        if args.out is None:
            name = "gpu_coldstart.smoke.json" if args.smoke else "gpu_coldstart.json"
            args.out = str(ROOT / "bench" / "results" / name)
        print(json.dumps(Bench(args).run(), indent=2))


if __name__ == "__main__":
    main()

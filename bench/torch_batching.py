"""The torch engine's continuous batch against the engine library in one process.

    python -m bench.torch_batching [--crowds 1,4,16,32] [--tokens 64] [--out bench/results]
    python -m bench.torch_batching --write-skeleton DIR    # the default model's config + tokenizer
    python -m bench.torch_batching --skeleton DIR ...      # that architecture, random weights

The default model's GGUF is materialized once into a float32 torch checkpoint (what a torch
node's registration writes). For each crowd size c, c different chat prompts each generate
`--tokens` tokens (sampled: temperature 0.8, top-p 0.95, `ignore_eos`), all sent at once, in
three ways, side by side in one run:

- `tessera`: the torch worker's batch (`services/engine/torch_engine/batching.py`) on a model
  bound from the tensor arena: transformers' continuous batching, every token picked by the
  engine's own seeded sampler (the plain rows together on the device, `row_sampling.py`); on a
  GPU each step replayed from a CUDA graph;
- `tessera_no_graphs` (on a GPU only): the same batch with every step run eagerly;
- `library`: transformers' continuous batching on the same checkpoint loaded the usual way
  (`from_pretrained`), sampling with the library's own per-request processors on the device,
  with its CUDA graphs on a GPU (the peer: what the engine library does in one process);
- `one_at_a_time`: the engine's one-request path, the requests one after another (the torch
  worker before it batched), for c <= 4.

On a CUDA machine the same command measures the GPU in bfloat16.

Output tokens per second from the first request sent to the last token, after an untimed
warm-up round of the same crowd on the same batch (`WARM_TOKENS`). Then `first_tokens`: what
a new batch's first requests wait (a cold start's first request meets a new batch), per way of
running its steps (on a GPU: every step from CUDA graphs, which captures each new shape at its
first use; decode steps alone from graphs; none). Prints one JSON object
and writes `<out>/torch_batching.json` and `.png` (`torch_batching_gpu.*` on a GPU). On a CUDA machine the same run measures the
GPU (`device` says which). The GPU machine has no room for the GGUF (what travels there is
limited), so there the run takes `--skeleton`: the default model's config and tokenizer, written
here by `--write-skeleton`, with random weights made on the spot (they cost the same to run).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig
from transformers.generation.configuration_utils import ContinuousBatchingConfig

from bench.common import machine_info, make_log
from cuda_ext import TensorArena
from ops.localcluster import REPO_ROOT, default_model_path
from services.engine.torch_engine.batching import BLOCK_TOKENS, ContinuousBatcher
from services.engine.torch_engine.engine import TorchEngine
from services.loader.torch_checkpoint import materialize, write_checkpoint
from shared.messages import SamplingParams

log = make_log("torch_batching")
TOPICS = ("a lighthouse", "the sea", "a fox", "mountains", "a city at night", "rain", "a library", "the moon")
KV_TOKENS = 8192


def prompts(engine: TorchEngine, n: int) -> list[list[int]]:
    return [
        engine.chat_ids([{"role": "user", "content": f"Write a short story about {TOPICS[i % len(TOPICS)]} (#{i})."}])
        for i in range(n)
    ]


def params(i: int, tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=tokens, temperature=0.8, top_p=0.95, seed=i, ignore_eos=True)


WARM_TOKENS = 8
"""Each side first serves the same crowd this many tokens long, untimed: a server's batch lives
on, so the timed round measures steps, not the first-use costs (CUDA graph captures, kernel
autotuning) that the warm-up pays."""


def run_tessera(engine: TorchEngine, batch: list[list[int]], tokens: int, graphs: bool | None = None) -> float:
    batcher = ContinuousBatcher(engine, max_batch=max(1, len(batch)), kv_tokens=KV_TOKENS, graphs=graphs)
    try:
        rate = 0.0
        for round, n in enumerate((min(WARM_TOKENS, tokens), tokens)):
            t0 = time.perf_counter()
            for i, p in enumerate(batch):
                batcher.add(f"r{round}-{i}", p, params(i, n))
            made, ended = 0, 0
            while ended < len(batch):
                for step in batcher.steps(0.05):
                    if step.error:
                        raise RuntimeError(step.error)
                    made += len(step.tokens)
                    ended += step.finish is not None
            rate = made / (time.perf_counter() - t0)
        return rate
    finally:
        batcher.close()


def run_library(model: Any, batch: list[list[int]], tokens: int) -> float:
    generation = GenerationConfig(do_sample=True, temperature=0.8, top_p=0.95, max_new_tokens=tokens, eos_token_id=-1)
    blocks = -(-KV_TOKENS // BLOCK_TOKENS)
    config = ContinuousBatchingConfig(
        block_size=BLOCK_TOKENS,
        num_blocks=blocks,
        max_batch_tokens=min(blocks * BLOCK_TOKENS, 2048),
        max_requests_per_batch=max(1, len(batch)),
        per_request_processors=True,
        use_cuda_graph=torch.cuda.is_available(),
    )
    manager = model.init_continuous_batching(generation_config=generation, continuous_batching_config=config)
    manager.start()
    try:
        rate = 0.0
        for round, n in enumerate((min(WARM_TOKENS, tokens), tokens)):
            t0 = time.perf_counter()
            for i, p in enumerate(batch):
                manager.add_request(p, request_id=f"r{round}-{i}", max_new_tokens=n, eos_token_id=-1)
            made = 0
            for _ in batch:
                result = manager.get_result(timeout=600)
                if result is None or result.error:
                    raise RuntimeError(f"the library's batch failed: {result}")
                made += len(result.generated_tokens)
            rate = made / (time.perf_counter() - t0)
        return rate
    finally:
        manager.stop(block=True, timeout=60)


FIRST_MODES: dict[str, bool | tuple[bool, bool]] = {
    "graphs": True,
    "decode_graphs": (False, True),
    "eager": False,
}
"""How a new batch's steps run, for `first_tokens`: every step from CUDA graphs, the decode
steps alone (a prefill's shape is new more often), or none."""


def first_tokens(engine: TorchEngine, modes: list[str]) -> dict[str, dict[str, float]]:
    """A new batch's first requests (what a cold start serves first), per mode: the first
    token of its first request, of a second one with a prompt of another length, and the
    first request's 16 tokens, in seconds from `add`."""
    prompts = [
        engine.chat_ids([{"role": "user", "content": "Hi."}]),
        engine.chat_ids([{"role": "user", "content": "Tell me about " + "the sea and the sky, " * 12}]),
    ]
    out: dict[str, dict[str, float]] = {}
    for mode in modes:
        batcher = ContinuousBatcher(engine, max_batch=8, kv_tokens=KV_TOKENS, graphs=FIRST_MODES[mode])
        try:
            timing: dict[str, float] = {}
            for name, prompt in zip(("first_ttft_s", "second_ttft_s"), prompts, strict=True):
                t0 = time.perf_counter()
                batcher.add(name, prompt, params(0, 16))
                first, done = None, False
                while not done:
                    for step in batcher.steps(0.001):
                        if step.error:
                            raise RuntimeError(step.error)
                        if first is None and step.tokens:
                            first = time.perf_counter() - t0
                        done = done or step.finish is not None
                timing[name] = first if first is not None else math.nan
                if name == "first_ttft_s":
                    timing["first_16_tokens_s"] = time.perf_counter() - t0
            out[mode] = timing
        finally:
            batcher.close()
    return out


def run_one_at_a_time(engine: TorchEngine, batch: list[list[int]], tokens: int) -> float:
    list(engine.steps(batch[0], params(0, min(WARM_TOKENS, tokens))))
    t0 = time.perf_counter()
    made = sum(len(list(engine.steps(p, params(i, tokens)))) for i, p in enumerate(batch))
    return made / (time.perf_counter() - t0)


def write_skeleton(dest: Path) -> None:
    gguf = default_model_path()
    AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(dest)
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(dest)


def random_checkpoint(skeleton: Path, dest: Path, dtype: torch.dtype) -> Path:
    """`skeleton`'s architecture with random weights, as a checkpoint a torch node loads."""
    config = AutoConfig.from_pretrained(skeleton)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    tensors = {n: p.detach().contiguous() for n, p in model.named_parameters()}
    return write_checkpoint(dest, tensors, config, AutoTokenizer.from_pretrained(skeleton), "random weights")


def plot(result: dict[str, Any], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # the `bench` extra is not installed: the JSON alone
        return

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for name, label in (
        ("tessera", "Tessera torch batch"),
        ("tessera_no_graphs", "Tessera, no CUDA graphs"),
        ("library", "transformers CB, one process"),
    ):
        if name not in result:
            continue
        xs = sorted(int(c) for c in result[name])
        ax.plot(xs, [result[name][str(c)] for c in xs], marker="o", label=label)
    xs = sorted(int(c) for c in result["one_at_a_time"])
    ax.plot(xs, [result["one_at_a_time"][str(c)] for c in xs], marker="s", ls="--", label="one at a time")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("requests at once")
    ax.set_ylabel("output tokens / s")
    ax.set_title(f"torch engine, SmolLM2-135M {result['dtype']}, {result['device']}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--crowds", default="1,4,16,32")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--out", type=Path, default=REPO_ROOT / "bench" / "results")
    ap.add_argument("--skeleton", type=Path, help="config + tokenizer: run that model with random weights")
    ap.add_argument("--write-skeleton", type=Path, help="write the default model's config + tokenizer there")
    args = ap.parse_args()
    if args.write_skeleton:
        write_skeleton(args.write_skeleton)
        return
    crowds = [int(c) for c in args.crowds.split(",")]
    load_before = os.getloadavg()
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU ({os.cpu_count()} cores)"

    # bfloat16 on a GPU (what a torch node registers there); float32 on the host, whose matmuls
    # have no fast bfloat16 path.
    dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    with tempfile.TemporaryDirectory(prefix="tessera-torch-bench-") as tmp:
        if args.skeleton:
            checkpoint = random_checkpoint(args.skeleton, Path(tmp) / "smol", dtype)
        else:
            checkpoint = materialize(default_model_path(), Path(tmp) / "smol", dtype=dtype)
        engine = TorchEngine.start(checkpoint, TensorArena(1 << 30))
        library: Any = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=dtype)
        library = library.to(engine.device).eval()
        result: dict[str, Any] = {"tessera": {}, "library": {}, "one_at_a_time": {}, "ratio_tessera_over_library": {}}
        cuda = torch.cuda.is_available()
        if cuda:
            result["tessera_no_graphs"] = {}
        for c in crowds:
            batch = prompts(engine, c)
            result["library"][str(c)] = run_library(library, batch, args.tokens)
            result["tessera"][str(c)] = run_tessera(engine, batch, args.tokens)
            if cuda:
                result["tessera_no_graphs"][str(c)] = run_tessera(engine, batch, args.tokens, graphs=False)
            if c <= 4:
                result["one_at_a_time"][str(c)] = run_one_at_a_time(engine, batch, args.tokens)
            result["ratio_tessera_over_library"][str(c)] = result["tessera"][str(c)] / result["library"][str(c)]
            log(
                f"c={c}: tessera {result['tessera'][str(c)]:.1f} tok/s, library {result['library'][str(c)]:.1f}, "
                f"ratio {result['ratio_tessera_over_library'][str(c)]:.2f}"
            )
        modes = list(FIRST_MODES) if cuda else ["eager"]
        result["first_tokens"] = first_tokens(engine, modes)
        log(f"first tokens of a new batch: {result['first_tokens']}")
        engine.close()

    top = str(max(crowds))
    result.update(
        {
            "device": device,
            "tokens_per_request": args.tokens,
            "dtype": str(dtype).removeprefix("torch."),
            "weights": "random" if args.skeleton else "the default model's GGUF",
            "threads": torch.get_num_threads(),
            "speedup_over_one_at_a_time": result["tessera"][top] / result["one_at_a_time"]["1"]
            if "1" in result["one_at_a_time"]
            else None,
            "machine": machine_info(load_before),
            "when": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        }
    )
    args.out.mkdir(parents=True, exist_ok=True)
    name = "torch_batching_gpu" if cuda else "torch_batching"
    (args.out / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, args.out / f"{name}.png")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

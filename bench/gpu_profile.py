"""Measure a GPU's prefill and decode iterations for the simulator's model shapes (issue 6).

    python3 -m bench.gpu_profile --raw /tmp/gpu-raw.json                 # on a CUDA machine
    .venv/bin/python -m bench.gpu_profile --compare /tmp/gpu-raw.json    # here: beside the model

The simulator's GPU node (`bench/sim/`: `gpu_prefill`, `gpu_decode`) is a roofline-like
model fitted to LLM-Mesh's A100 figures. This runs the three shapes it simulates (Llama-3.2-3B,
Llama-2-7B, Llama-2-13B; bf16, random weights: timing does not depend on them) as a
Llama-shaped decoder in plain PyTorch on the GPU at hand, on the §5.2 grid (prefill by input
length; decode by batch and mean length, over a KV cache of that size); `--compare` puts each
measurement beside what the simulator's model says (`bench/results/gpu-profile.json`), so the
model can be checked against a real GPU. Measuring needs `torch` (not a dependency of this
project: the GPU machine has it); it is run by hand and never by the test suite.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

SHAPES: dict[float, dict[str, int]] = {
    3.0: {
        "hidden_size": 3072,
        "num_hidden_layers": 28,
        "num_attention_heads": 24,
        "num_key_value_heads": 8,
        "intermediate_size": 8192,
        "vocab_size": 128256,
    },
    7.0: {
        "hidden_size": 4096,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "intermediate_size": 11008,
        "vocab_size": 32000,
    },
    13.0: {
        "hidden_size": 5120,
        "num_hidden_layers": 40,
        "num_attention_heads": 40,
        "num_key_value_heads": 40,
        "intermediate_size": 13824,
        "vocab_size": 32000,
    },
}
"""The simulator's sizes (`bench.trace.SIZES_B`), as Llama configurations."""
PREFILL_LENGTHS = (64, 256, 1024, 2048, 4096)
DECODE_BATCHES = (1, 4, 16, 64)
DECODE_LENGTHS = (256, 1024, 4096)
KV_TOKEN_BUDGET = 32 * 1024
"""Batch × length of a decode point at most (the KV cache must fit beside the weights)."""


def _time(fn: Any, torch: Any, repeats: int = 5) -> float:
    fn()  # warm-up: kernels chosen, memory allocated
    torch.cuda.synchronize()
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


class _Llama:
    """The forward pass of a Llama-shaped decoder in plain PyTorch (bf16, random weights):
    per layer RMSNorm, QKV, attention (SDPA, grouped KV heads), output projection, SwiGLU
    MLP; the LM head on the last position. What an iteration costs, without a serving
    framework's scheduler around it (RoPE left out: elementwise, a rounding error here)."""

    def __init__(self, shape: dict[str, int], torch: Any) -> None:
        self.t = torch
        h, self.layers = shape["hidden_size"], shape["num_hidden_layers"]
        self.heads, self.kv_heads = shape["num_attention_heads"], shape["num_key_value_heads"]
        self.d = h // self.heads
        inter, vocab = shape["intermediate_size"], shape["vocab_size"]
        kv = self.kv_heads * self.d

        def w(*dims: int) -> Any:
            return torch.randn(*dims, device="cuda", dtype=torch.bfloat16) * 0.02

        self.w = [(w(h, h + 2 * kv), w(h, h), w(h, 2 * inter), w(inter, h)) for _ in range(self.layers)]
        self.head = w(h, vocab)
        self.h = h

    def _norm(self, x: Any) -> Any:
        return x * self.t.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5).to(x.dtype)

    def forward(self, x: Any, cache: list[tuple[Any, Any]] | None, at: int) -> Any:
        """x: (batch, tokens, hidden). With `cache` (per layer K and V of (batch, kv heads,
        context, head dim)), the tokens are written at `at` and attend to everything before;
        without, the tokens attend causally to each other (a prefill)."""
        t = self.t
        F = t.nn.functional
        b, n, _ = x.shape
        for i, (qkv_w, o_w, up_w, down_w) in enumerate(self.w):
            qkv = self._norm(x) @ qkv_w
            q, k, v = qkv.split([self.h, self.kv_heads * self.d, self.kv_heads * self.d], dim=-1)
            q = q.view(b, n, self.heads, self.d).transpose(1, 2)
            k = k.view(b, n, self.kv_heads, self.d).transpose(1, 2)
            v = v.view(b, n, self.kv_heads, self.d).transpose(1, 2)
            if cache is None:
                a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            else:
                kc, vc = cache[i]
                kc[:, :, at : at + n] = k
                vc[:, :, at : at + n] = v
                a = F.scaled_dot_product_attention(q, kc[:, :, : at + n], vc[:, :, : at + n], enable_gqa=True)
            x = x + a.transpose(1, 2).reshape(b, n, self.h) @ o_w
            gate, up = (self._norm(x) @ up_w).chunk(2, dim=-1)
            x = x + (F.silu(gate) * up) @ down_w
        return self._norm(x[:, -1]) @ self.head


def measure(params_b: float) -> dict[str, Any]:
    import torch

    model = _Llama(SHAPES[params_b], torch)
    prefill = []
    decode = []
    with torch.inference_mode():
        for n in PREFILL_LENGTHS:
            x = torch.randn(1, n, model.h, device="cuda", dtype=torch.bfloat16)
            prefill.append((n, _time(lambda x=x: model.forward(x, None, 0), torch)))
        for b in DECODE_BATCHES:
            for n in DECODE_LENGTHS:
                if b * n > KV_TOKEN_BUDGET:
                    continue
                cache = [
                    (
                        torch.zeros(b, model.kv_heads, n + 1, model.d, device="cuda", dtype=torch.bfloat16),
                        torch.zeros(b, model.kv_heads, n + 1, model.d, device="cuda", dtype=torch.bfloat16),
                    )
                    for _ in range(model.layers)
                ]
                x = torch.randn(b, 1, model.h, device="cuda", dtype=torch.bfloat16)
                # Captured as a CUDA graph, as serving engines run decode steps (vLLM): one
                # launch rather than hundreds of small ones.
                model.forward(x, cache, n)
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    model.forward(x, cache, n)
                decode.append((b, n, _time(graph.replay, torch)))
                del graph, cache
                torch.cuda.empty_cache()
    return {"prefill": prefill, "decode": decode}


def compare(params_b: float, measured: dict[str, Any]) -> dict[str, Any]:
    """Each measurement beside the simulator's GPU model at the same point."""
    from bench.sim import gpu_decode, gpu_prefill

    return {
        "prefill": [
            {
                "input_tokens": n,
                "measured_s": round(s, 5),
                "sim_model_s": round(gpu_prefill(params_b, n), 5),
                "sim_over_measured": round(gpu_prefill(params_b, n) / s, 2),
            }
            for n, s in measured["prefill"]
        ],
        "decode": [
            {
                "batch": b,
                "mean_length": n,
                "measured_s": round(s, 5),
                "sim_model_s": round(gpu_decode(params_b, b, n), 5),
                "sim_over_measured": round(gpu_decode(params_b, b, n) / s, 2),
            }
            for b, n, s in measured["decode"]
        ],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--raw", help="measure on this machine's GPU and write the times here")
    ap.add_argument("--compare", help="raw times to put beside the simulator's GPU model")
    ap.add_argument("--out", default="bench/results/gpu-profile.json")
    ap.add_argument("--sizes", default="3,7,13")
    args = ap.parse_args(argv)
    if args.compare:
        raw = json.loads(Path(args.compare).read_text())
        raw["models"] = {name: compare(float(name.rstrip("B")), m) for name, m in raw["models"].items()}
        out = Path(args.out)
        out.write_text(json.dumps(raw, indent=2) + "\n")
        print(json.dumps(summary(raw), indent=2))
        return 0
    import torch

    if not torch.cuda.is_available():
        print("no CUDA device here: run this on a GPU machine", file=sys.stderr)
        return 2
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "note": "bf16, random weights, a Llama-shaped decoder in plain PyTorch (SDPA attention); "
        "decode: one step over a KV cache of batch x mean_length tokens, as a CUDA graph; "
        "medians of 5 after a warm-up",
        "models": {},
    }
    for size in (float(s) for s in args.sizes.split(",")):
        print(f"[gpu_profile] {size:g}B ...", file=sys.stderr, flush=True)
        result["models"][f"{size:g}B"] = measure(size)
        torch.cuda.empty_cache()  # the model is gone with measure's frame
    Path(args.raw or "gpu-raw.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


def summary(result: dict[str, Any]) -> dict[str, Any]:
    """Per model, the range of the simulator's model over the measurement."""
    out = {}
    for name, m in result["models"].items():
        p = [x["sim_over_measured"] for x in m["prefill"]]
        d = [x["sim_over_measured"] for x in m["decode"]]
        out[name] = {"prefill_sim_over_measured": [min(p), max(p)], "decode_sim_over_measured": [min(d), max(d)]}
    return {"device": result["device"], "models": out}


if __name__ == "__main__":
    raise SystemExit(main())

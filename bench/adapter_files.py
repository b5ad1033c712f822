"""The LoRA adapters of `bench/adapters.py`: a few made with PEFT on the Hugging Face form of the
default model, the rest derived from them, and the ones llama-server serves converted to GGUF
LoRA with llama.cpp's own converter.

PEFT takes about 5 s per adapter here (it loads the base each time), so `peft` adapters are made
with `tests.helpers.adapters.make_adapter` (seeds 1..peft) and the rest are perturbed copies of
them: the same `adapter_config.json`, every matrix scaled and moved by noise of its own seed,
written with safetensors. Each is a distinct file (its own bytes, so its own adapter id, and an
update of its own), with the shape and targets PEFT gave.

`make_adapter` draws its matrices at a std of 0.5, sized for the tiny test checkpoint; on the
real 135M model that update is tens of times the weights (the output is noise). Every adapter
here is scaled by `UPDATE_SCALE` on both A and B (the update by its square): of the order of the
model's own weights, so greedy output changes and stays text."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.llama_server import download_source
from tests.helpers.adapters import make_adapter

WEIGHTS = "adapter_model.safetensors"
CONFIG = "adapter_config.json"
UPDATE_SCALE = 0.1
"""Factor on each LoRA matrix that `make_adapter` drew (std 0.5 -> 0.05: B·A·alpha/r entries of
std ≈ 0.014 with rank 8, alpha 16)."""
DERIVE_KEEP = 0.5**0.5
"""A derived adapter's matrices: its parent's times this, plus noise of std PERTURB_STD; half its
variance its parent's, half new, its size the parent's (0.05 after UPDATE_SCALE)."""
PERTURB_STD = 0.05 * 0.5**0.5
CONVERT_TIMEOUT_S = 300.0


def rescale(path: Path, factor: float, seed: int | None = None) -> None:
    """Scale every matrix of the adapter at `path` by `factor` (and add noise of `seed`), in place."""
    import torch
    from safetensors.torch import load_file, save_file

    tensors = load_file(path / WEIGHTS)
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    out = {}
    for name in sorted(tensors):
        t = tensors[name].to(torch.float32) * factor
        if gen is not None:
            t = t + torch.randn(t.shape, generator=gen) * PERTURB_STD
        out[name] = t.contiguous()
    save_file(out, str(path / WEIGHTS), metadata={"format": "pt"})


def derive(source: Path, dest: Path, seed: int) -> Path:
    """A copy of the adapter at `source` (config as it is), its matrices half replaced by noise of
    `seed`: as large as its parent's, and its greedy text its own."""
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copy2(source / CONFIG, dest / CONFIG)
    shutil.copy2(source / WEIGHTS, dest / WEIGHTS)
    rescale(dest, DERIVE_KEEP, seed)
    return dest


def make_adapters(base: Path, dest: Path, count: int, peft: int) -> list[Path]:
    """`count` adapters in `dest/lora-NNN`: the first `peft` made with PEFT (seeds 1..peft,
    scaled by UPDATE_SCALE), the rest derived from them in turn (seed 1000 + index)."""
    peft = max(1, min(peft, count))
    out = []
    for i in range(peft):
        path = make_adapter(base, dest / f"lora-{i:03d}", seed=i + 1)
        (path / "README.md").unlink(missing_ok=True)
        rescale(path, UPDATE_SCALE)
        out.append(path)
    for i in range(peft, count):
        out.append(derive(out[i % peft], dest / f"lora-{i:03d}", seed=1000 + i))
    return out


def converter(workdir: Path) -> Path:
    """llama.cpp's `convert_lora_to_gguf.py`, from the same source `bench/llama_server.py` builds
    llama-server from (it imports the `conversion/` package and `gguf-py/` beside it)."""
    return download_source(workdir) / "convert_lora_to_gguf.py"


CONVERT_DRIVER = """
import runpy, sys
script, base, *pairs = sys.argv[1:]
sys.path.insert(0, str(__import__("pathlib").Path(script).parent))  # its `conversion` package
for adapter, out in zip(pairs[::2], pairs[1::2]):
    sys.argv = [script, "--base", base, "--outtype", "f32", "--outfile", out, adapter]
    runpy.run_path(script, run_name="__main__")
"""
"""Runs the converter on each adapter in one process: importing torch and transformers anew for
each (a process each) took half a minute an adapter on a loaded 2-core machine."""


def to_ggufs(base: Path, adapters: list[Path], dest: Path) -> list[Path]:
    """Each of `adapters` converted for llama-server (f32, as PEFT saved them), into `dest`."""
    dest.mkdir(parents=True, exist_ok=True)
    outs = [dest / f"{a.name}.gguf" for a in adapters]
    env = dict(os.environ)
    env.pop("NO_LOCAL_GGUF", None)  # the converter's own gguf-py, of its llama.cpp's version
    with tempfile.TemporaryDirectory(prefix="tessera-lora-convert-") as tmp:
        script = converter(Path(tmp))
        pairs = [str(x) for a, o in zip(adapters, outs, strict=True) for x in (a, o)]
        p = subprocess.run(
            [sys.executable, "-c", CONVERT_DRIVER, str(script), str(base), *pairs],
            capture_output=True,
            text=True,
            env=env,
            timeout=CONVERT_TIMEOUT_S,
            check=False,
        )
    missing = [o for o in outs if not o.is_file()]
    if p.returncode != 0 or missing:
        raise RuntimeError(
            f"convert_lora_to_gguf.py failed ({p.returncode}), {len(missing)} missing:\n{p.stderr[-2000:]}"
        )
    return outs

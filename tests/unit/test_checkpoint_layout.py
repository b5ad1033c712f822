"""A torch checkpoint's file in the order a pipeline needs it (services/loader/torch_checkpoint.py
`save_in_order`) and where its parts lie among a block set's blocks (services/loader/layout.py)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="writing a checkpoint needs torch")

import torch
from safetensors.torch import load_file

from policy.pipeline_stages import Layout, needs
from services.loader.blockset import block_set_of
from services.loader.layout import stage_layout
from services.loader.torch_checkpoint import save_in_order
from shared.artifact import EMBED, NORM, TORCH_WEIGHTS


def offsets(path: Path) -> dict[str, list[int]]:
    (n,) = struct.unpack("<Q", path.read_bytes()[:8])
    header = json.loads(path.read_bytes()[8 : 8 + n])
    return {k: v["data_offsets"] for k, v in header.items() if k != "__metadata__"}


def test_tensors_lie_in_the_given_order_and_every_reader_reads_them(tmp_path: Path) -> None:
    tensors = {
        "model.layers.2.w": torch.randn(3, 5),
        "model.layers.10.w": torch.randn(7),
        "a": torch.randn(3).to(torch.bfloat16),
        "z": torch.arange(5),
    }
    save_in_order(tensors, tmp_path / "m.safetensors", {"format": "pt"})
    at = offsets(tmp_path / "m.safetensors")
    assert sorted(at, key=lambda k: at[k][0]) == list(tensors)  # not save_file's dtype-then-name order
    back = load_file(tmp_path / "m.safetensors")
    assert all(torch.equal(back[k], v) for k, v in tensors.items())


def checkpoint(root: Path, layers: int, width: int) -> None:
    """A tied-head checkpoint laid out as registration writes it: the norm, the embedding, the
    layers in order."""
    root.mkdir()
    (root / "config.json").write_text("{}")
    tensors = {NORM: torch.ones(width), EMBED: torch.randn(64, width)}
    for i in range(layers):
        tensors[f"model.layers.{i}.mlp.up_proj.weight"] = torch.randn(width, width)
        tensors[f"model.layers.{i}.input_layernorm.weight"] = torch.ones(width)
    save_in_order(tensors, root / TORCH_WEIGHTS, {"format": "pt"})


def test_each_unit_s_blocks_follow_the_file_and_the_tied_head_needs_the_embedding(tmp_path: Path) -> None:
    root = tmp_path / "torch"
    checkpoint(root, layers=4, width=64)  # 16 KB a layer
    bs = block_set_of(root, ["config.json", TORCH_WEIGHTS], "t", block_bytes=8192)
    shape = stage_layout(root, bs)
    assert shape.blocks == bs.blocks and len(shape.units) == 5  # four layers, then the head
    data = 2 + 8 + struct.unpack("<Q", (root / TORCH_WEIGHTS).read_bytes()[:8])[0]  # config.json, header
    at = offsets(root / TORCH_WEIGHTS)

    def blocks(lo: int, hi: int) -> tuple[int, int]:
        return (data + lo) // 8192, (data + hi - 1) // 8192

    assert shape.lead == -(-data // 8192)
    assert shape.first == (blocks(*at[EMBED]),)
    layer0 = [blocks(*at[f"model.layers.0.{p}"]) for p in ("mlp.up_proj.weight", "input_layernorm.weight")]
    assert shape.units[0] == ((min(b[0] for b in layer0), max(b[1] for b in layer0)),)
    # The head (tied): the norm, in the lead, and the embedding after it.
    norm, embed = blocks(*at[NORM]), blocks(*at[EMBED])
    assert norm[1] < shape.lead and shape.units[-1] == ((min(norm[0], embed[0]), embed[1]),)
    layout = Layout(shape.blocks, shape.lead, shape.units, shape.first)
    assert needs(layout, 4, 5) < needs(layout, 0, 1)  # the head alone: part of what the first stage holds

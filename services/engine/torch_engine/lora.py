"""LoRA adapters applied per row in one step of the torch engine's batch (issue 34): Punica's and
S-LoRA's idea (each token of a packed step carries its request's adapter), in plain tensor
operations. Every linear an adapter may update is wrapped once, when the batch is built; the
adapters' A and B matrices sit stacked in `MAX_LORAS` slots of fixed shape, and a step's
one-hot table says which slot each token's row uses (none: the base). The shapes never change,
so a CUDA graph captured once replays with any adapters loaded, and a step costs
`slots × rank × (in + out)` more per token and linear: about 6 % of a 4096-wide linear at 8
slots of rank 16.

An adapter is read from the store's kept PEFT file (`shared.adapters`) into a free slot at its
first request; its update's factor (`AdapterRef.scale`) is folded into B."""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from services.engine.batch_types import AdapterLoad
from shared.adapters import ADAPTER_WEIGHTS, AdapterArtifact

MAX_LORAS = 8
"""Adapters one step applies at most (each row its own; vLLM's nodes take as many,
`vllm_engine/params.py`); more wait for a slot."""

_PEFT_PREFIX = "base_model.model."


@dataclass(frozen=True)
class LoraShape:
    """What a batch is built LoRA-able for: the linears (by their last name, `q_proj`) and the
    largest rank of the adapters the store keeps for its model."""

    targets: frozenset[str]
    rank: int

    def covers(self, targets: Iterable[str], rank: int) -> bool:
        return set(targets) <= self.targets and rank <= self.rank


class LoraLinear(nn.Module):
    """A linear and its slots' low-rank updates: `base(x) + Σ_slot onehot · (x Aᵀ) Bᵀ`."""

    a: torch.Tensor
    b: torch.Tensor

    def __init__(self, base: nn.Linear, slots: int, rank: int, rows: RowLoras) -> None:
        super().__init__()
        self.base = base
        w = base.weight
        self.register_buffer("a", torch.zeros((slots, rank, w.shape[1]), dtype=w.dtype, device=w.device))
        self.register_buffer("b", torch.zeros((slots, w.shape[0], rank), dtype=w.dtype, device=w.device))
        self.rows = [rows]  # a list: not a submodule of this one

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        flat = x.reshape(-1, x.shape[-1])
        onehot = self.rows[0].onehot[: flat.shape[0]].to(x.dtype)
        low = torch.einsum("ti,sri->tsr", flat, self.a) * onehot[:, :, None]
        return y + torch.einsum("tsr,sor->to", low, self.b).reshape(y.shape)


def unwrap(model: nn.Module) -> None:
    """Put back the plain linears of a model a LoRA-able batch wrapped."""
    for module in list(model.modules()):
        for child, linear in list(module.named_children()):
            if isinstance(linear, LoraLinear):
                setattr(module, child, linear.base)


def kept_shape(kept: Iterable[AdapterArtifact]) -> LoraShape | None:
    """The shape that takes every adapter the store keeps for a model (None: it keeps none)."""
    kept = list(kept)
    if not kept:
        return None
    return LoraShape(frozenset(t for a in kept for t in a.targets), max(a.rank for a in kept))


class RowLoras:
    """The wrapped linears of one model and its adapter slots. `fill` is called on the library's
    thread as a step is formed; `load` and `free` between steps, on a slot no row uses."""

    def __init__(self, model: nn.Module, shape: LoraShape, max_tokens: int, slots: int = MAX_LORAS) -> None:
        self.shape = shape
        self.slots: list[str | None] = [None] * slots
        self.linears: dict[str, LoraLinear] = {}
        first = next(model.parameters())
        unwrap(model)  # a batch built again on the same model
        self.onehot = torch.zeros((max_tokens, slots), dtype=torch.float32, device=first.device)
        self._staging = torch.zeros((max_tokens, slots), dtype=torch.float32)
        for name, module in list(model.named_modules()):
            for child, linear in list(module.named_children()):
                if child in shape.targets and isinstance(linear, nn.Linear):
                    wrapped = LoraLinear(linear, slots, shape.rank, self)
                    setattr(module, child, wrapped)
                    self.linears[f"{name}.{child}" if name else child] = wrapped
        if not self.linears:
            raise ValueError(f"the model has no linear named any of {sorted(shape.targets)}")

    def slot_of(self, name: str) -> int | None:
        return self.slots.index(name) if name in self.slots else None

    def load(self, name: str, path: str, scale: float, busy: set[int]) -> AdapterLoad | None:
        """Read the adapter into a slot no row of `busy` uses (None: every slot is in use)."""
        free = [i for i, held in enumerate(self.slots) if held is None]
        idle = [i for i in range(len(self.slots)) if i not in busy]
        if not free and not idle:
            return None
        slot = (free or idle)[0]
        t0 = time.monotonic()
        weights = load_file(str(Path(path) / ADAPTER_WEIGHTS))
        t1 = time.monotonic()
        self.slots[slot] = None
        with torch.no_grad():
            for each in self.linears.values():
                each.a[slot].zero_()
                each.b[slot].zero_()
            for key, a in weights.items():
                if not key.endswith(".lora_A.weight"):
                    continue
                prefix = key.removesuffix(".lora_A.weight")
                linear = self.linears.get(prefix.removeprefix(_PEFT_PREFIX))
                if linear is None:
                    raise ValueError(f"the adapter updates `{prefix}`, which this batch was not built to update")
                b = weights[f"{prefix}.lora_B.weight"]
                rank = a.shape[0]
                linear.a[slot, :rank].copy_(a)
                linear.b[slot, :, :rank].copy_(b * scale)
        self.slots[slot] = name
        return AdapterLoad(name, t1 - t0, time.monotonic() - t1)

    def free(self, name: str) -> None:
        slot = self.slot_of(name)
        if slot is not None:
            self.slots[slot] = None

    def fill(self, rows: Iterable[tuple[int, int]]) -> None:
        """A step's table: `rows` are (slot, tokens) in the order the step packs its tokens
        (slot -1: the base's)."""
        self._staging.zero_()
        at = 0
        for slot, tokens in rows:
            if slot >= 0:
                self._staging[at : at + tokens, slot] = 1.0
            at += tokens
        self.onehot.copy_(self._staging)

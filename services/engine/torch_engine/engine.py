"""The torch engine's core for one model: a start binds the checkpoint's tensors into a meta-device
skeleton (`binding.py`), reading only those the arena lacks (a model scaled to zero, or a fine-tune
of a resident base, reads little or nothing: Tangram §3.1); `steps` is the one-request path.
"""

from __future__ import annotations

import json
from collections.abc import Generator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoTokenizer

from cuda_ext import TensorArena, TensorSpec
from cuda_ext.ledger import Placement
from cuda_ext.progress import FillSignal, FillWaiter
from services.engine.batch_types import ends_of_sequence
from services.engine.torch_engine.binding import BoundModel, bind, skeleton, units_in_order
from services.engine.torch_engine.guides import Row
from shared.artifact import TORCH_MANIFEST, TORCH_WEIGHTS
from shared.messages import FinishReason, SamplingParams, TokenLogprob


def read_manifest(checkpoint: Path) -> list[TensorSpec]:
    manifest = json.loads((checkpoint / TORCH_MANIFEST).read_text())
    return [
        TensorSpec(t["name"], t["digest"], getattr(torch, t["dtype"]), tuple(t["shape"])) for t in manifest["tensors"]
    ]


@dataclass
class TorchEngine:
    bound: BoundModel
    tokenizer: Any
    arena: TensorArena
    read_bytes: int
    """Bytes this start read from the checkpoint file (0 when the arena held everything)."""
    fill: FillWaiter | None
    """Where its forward pass waits for tensors another process still copies; None: all in."""

    def __post_init__(self) -> None:
        self.model = self.bound.model
        self.device = self.arena.device
        self.eos_ids = ends_of_sequence(self.tokenizer, self.model.config.eos_token_id)

    @classmethod
    def start(
        cls, checkpoint: Path, arena: TensorArena, placement: Placement | None = None, fill: FillSignal | None = None
    ) -> TorchEngine:
        """Bind the checkpoint's model where `placement` (the node arena's book) or else the
        arena's own book puts it, reading only what they lack. `fill`: the engine still copies
        what `placement` filled; each unit of the forward pass waits for its own (TIDAL §5)."""
        specs = read_manifest(checkpoint)
        if placement is not None:
            resident = {s.name for s in specs if s.digest not in placement.copy}
        else:
            resident = {s.name for s in specs if arena.resident(s.digest) is not None}
        with safe_open(str(checkpoint / TORCH_WEIGHTS), framework="pt") as f:
            source = {s.name: f.get_tensor(s.name) for s in specs if s.name not in resident}
        units = units_in_order([s.name for s in specs])
        by_name = {s.name: s for s in specs}
        groups = [[by_name[n] for n in names] for _, names in units]
        loaded = arena.load(groups, source, placement)
        waiter = FillWaiter(fill, [[s.digest for s in g] for g in groups]) if fill is not None else None
        model = skeleton(AutoConfig.from_pretrained(checkpoint), specs[0].dtype)
        bound = bind(model, loaded, arena.device, [u for u, _ in units], waiter.wait if waiter else None)
        tokenizer = AutoTokenizer.from_pretrained(checkpoint)
        if arena.ledger is None:
            # Another worker may bind these tensors as soon as the engine hears of this load:
            # they must be in by then (the copies overlapped the binding and the tokenizer).
            loaded.synchronize()
        return cls(bound, tokenizer, arena, sum(t.numel() * t.element_size() for t in source.values()), waiter)

    def close(self) -> None:
        """Scale to zero: the weights stay resident in the arena until it evicts them."""
        self.bound.stop_waiting()
        self.arena.release(self.bound.loaded)

    def chat_ids(self, messages: Sequence[dict[str, str]]) -> list[int]:
        rendered = self.tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False)
        return list(self.tokenizer(rendered, add_special_tokens=False)["input_ids"])

    def steps(self, prompt_ids: Sequence[int], params: SamplingParams) -> Generator[tuple[int, TokenLogprob | None]]:
        """The completion, one forward pass a token (a caller that stops reading stops it)."""
        row = Row(params, list(prompt_ids), self.eos_ids)
        with torch.inference_mode():
            step = self.model(input_ids=torch.tensor([row.context], device=self.device), use_cache=True)
            self.bound.stop_waiting()  # every layer has been waited for once
            while True:
                token = row.pick(step.logits[0, -1].float().cpu().numpy())
                if row.finish is FinishReason.STOP:
                    return
                yield token, row.logprobs[-1]
                if row.finish is not None:
                    return
                ids = torch.tensor([[token]], device=self.device)
                step = self.model(input_ids=ids, past_key_values=step.past_key_values, use_cache=True)

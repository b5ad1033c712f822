"""A layer range of a model run on its own (FaaScale §4.3): transformers' code on a config with only
its layers, renumbered from 0 (so KV cache, positions and masks work as in the whole model),
reading only its range's tensors. The first stage embeds; the last applies the final norm and the
head (a tied head is the embedding, which it then reads too). Served by `stage_wire.py`.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from transformers import AutoConfig

from services.engine.torch_engine.binding import materialize_buffers, skeleton
from services.engine.torch_engine.engine import read_manifest
from shared.artifact import EMBED, HEAD, NORM, TORCH_WEIGHTS, layer_of


@dataclass(frozen=True)
class LayerRange:
    lo: int
    hi: int
    layers: int
    """The model's decoder layers in all."""
    head: bool | None = None
    """Whether it applies the final norm and the head (None: if it runs the last layer). The head
    alone (lo == hi == layers): a tied head held apart from the last layers (`policy.pipeline_stages`)."""

    def __post_init__(self) -> None:
        alone = self.lo == self.hi == self.layers and self.head
        if not (0 <= self.lo <= self.hi <= self.layers and (self.lo < self.hi or alone)):
            raise ValueError(f"layers [{self.lo}, {self.hi}) are not a range of a {self.layers}-layer model")

    @property
    def first(self) -> bool:
        return self.lo == 0

    @property
    def last(self) -> bool:
        return self.hi == self.layers if self.head is None else self.head


def stage_tensors(names: Sequence[str], r: LayerRange, tied: bool) -> dict[str, str]:
    """The checkpoint tensors a stage needs, each with its name in the stage's model (its
    layers renumbered from 0)."""
    out: dict[str, str] = {}
    for name in names:
        i = layer_of(name)
        if i is not None:
            if r.lo <= i < r.hi:
                out[name] = name.replace(f"model.layers.{i}.", f"model.layers.{i - r.lo}.", 1)
        elif name == EMBED and (r.first or (r.last and tied)):
            out[name] = name
        elif name in (NORM, HEAD) and r.last:
            out[name] = name
    return out


@dataclass
class Stage:
    """One layer range, loaded, with a KV cache per session (one generation)."""

    model: Any
    range: LayerRange
    read_bytes: int
    caches: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def load(cls, checkpoint: Path, r: LayerRange, device: str = "cpu") -> Stage:
        config = AutoConfig.from_pretrained(checkpoint)
        if config.num_hidden_layers != r.layers:
            raise ValueError(f"the checkpoint has {config.num_hidden_layers} layers, not {r.layers}")
        sub = copy.deepcopy(config)
        sub.num_hidden_layers = r.hi - r.lo
        tied = bool(getattr(config, "tie_word_embeddings", False))
        wanted = stage_tensors([s.name for s in read_manifest(checkpoint)], r, tied)
        with safe_open(str(checkpoint / TORCH_WEIGHTS), framework="pt", device=device) as f:
            state = {mine: f.get_tensor(theirs) for theirs, mine in wanted.items()}
        dtype = next(iter(state.values())).dtype
        read = sum(t.numel() * t.element_size() for t in state.values())
        model = skeleton(sub, dtype)
        if r.last and tied:
            state[HEAD] = state[EMBED]
        model.load_state_dict(state, strict=False, assign=True)
        if not r.last:
            model.model.norm = torch.nn.Identity()  # the next stage's layers take the raw residual stream
        materialize_buffers(model, torch.device(device))  # the rotary frequencies, built on meta
        # It never runs the embedding if fed hidden states, nor the head if not last.
        unused = {name for name, runs in ((EMBED, r.first), (HEAD, r.last)) if not runs}
        left = [n for n, p in model.named_parameters() if p.is_meta and n not in unused]
        if left:
            raise RuntimeError(f"stage [{r.lo}, {r.hi}) is missing {left[:3]}")
        return cls(model.eval(), r, read)

    def forward(self, session: str, x: torch.Tensor) -> torch.Tensor:
        """Token ids [1, T] (the first stage) or hidden states [1, T, H] in; hidden states out,
        or from the last stage the last position's logits [V] (float32)."""
        cache = self.caches.get(session)
        with torch.inference_mode():
            if self.range.lo == self.range.hi:  # the head alone: no layer, no KV cache
                return self.model.lm_head(self.model.model.norm(x[:, -1:]))[:, -1].float()[0]
            kwargs: dict[str, Any] = {"input_ids": x} if self.range.first else {"inputs_embeds": x}
            out = self.model.model(**kwargs, past_key_values=cache, use_cache=True)
            self.caches[session] = out.past_key_values
            hidden = out.last_hidden_state
            return self.model.lm_head(hidden[:, -1]).float()[0] if self.range.last else hidden

    def drop(self, session: str) -> None:
        self.caches.pop(session, None)

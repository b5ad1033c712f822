"""A model bound to arena memory: a meta-device skeleton (≈ 13 ms even at 8B) whose parameters are
views of the arena's tensors; each unit's forward waits for its own copy, so the first layers run
while the last are still on the link (TIDAL §5)."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch.utils.hooks import RemovableHandle
from transformers import AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from cuda_ext import Loaded

_LAYER = re.compile(r"^(.*\.layers\.\d+)\.")


def skeleton(config: PretrainedConfig, dtype: torch.dtype) -> PreTrainedModel:
    """The model's modules with every parameter and buffer on the meta device: no memory."""
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=dtype).eval()


def units_in_order(names: Sequence[str]) -> list[tuple[str, list[str]]]:
    """Parameter names (in access order) grouped by the module whose forward reads them first (a
    decoder layer, else the parameter's own), units in order of first access."""
    units: dict[str, list[str]] = {}
    for name in names:
        layer = _LAYER.match(name)
        units.setdefault(layer.group(1) if layer else name.rpartition(".")[0], []).append(name)
    return list(units.items())


@dataclass
class BoundModel:
    model: PreTrainedModel
    loaded: Loaded
    waits: list[RemovableHandle]

    def stop_waiting(self) -> None:
        """Once every unit is copied (after the first forward), drop the per-unit waits."""
        for handle in self.waits:
            handle.remove()
        self.waits.clear()


def bind(
    model: PreTrainedModel,
    loaded: Loaded,
    device: torch.device,
    units: Sequence[str] | None = None,
    fill_wait: Callable[[int], None] | None = None,
) -> BoundModel:
    """Point `model`'s parameters at `loaded`'s views. With `units` (the load's groups, in order),
    each unit's forward first waits on the device for its group's copy, and `fill_wait(its
    index)` for the engine's copy of its tensors into the node's arena."""
    for name, tensor in loaded.tensors.items():
        owner, _, attr = name.rpartition(".")
        module = model.get_submodule(owner)
        if attr in module._parameters:
            module._parameters[attr] = torch.nn.Parameter(tensor, requires_grad=False)
        else:
            module._buffers[attr] = tensor
    if model.config.get_text_config().tie_word_embeddings:
        out, inp = model.get_output_embeddings(), model.get_input_embeddings()
        if out is not None:
            out.weight = inp.weight
    materialize_buffers(model, device)
    left = [n for n, p in model.named_parameters() if p.is_meta]
    if left:
        raise ValueError(f"no tensor for {left[:5]} ({len(left)} in all)")
    waits: list[RemovableHandle] = []
    cuda = device.type == "cuda"
    if units is not None and (cuda or fill_wait is not None):
        for g, unit in enumerate(units):

            def wait(_m: torch.nn.Module, _args: object, g: int = g) -> None:
                if fill_wait is not None:
                    fill_wait(g)
                # A CUDA graph may not wait on another stream's work; one is captured only after
                # an eager pass on the same stream waited (the batch's library warms up so), and
                # replays after it.
                if cuda and not torch.cuda.is_current_stream_capturing():
                    loaded.wait(g)

            waits.append(model.get_submodule(unit).register_forward_pre_hook(wait))
    return BoundModel(model, loaded, waits)


def materialize_buffers(model: torch.nn.Module, device: torch.device) -> None:
    """Buffers computed from the config (rotary frequencies) are not in a checkpoint: build
    those modules again on the device."""
    for name, module in list(model.named_modules()):
        if any(b.is_meta for b in module.buffers(recurse=False)):
            if not type(module).__name__.endswith("RotaryEmbedding"):
                raise ValueError(f"{name} ({type(module).__name__}) has buffers no checkpoint holds")
            config = getattr(module, "config", None) or model.config  # type: ignore[union-attr]
            with torch.device(device):
                fresh = type(module)(config=config)
            owner, _, attr = name.rpartition(".")
            setattr(model.get_submodule(owner), attr, fresh)

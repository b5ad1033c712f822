"""Where a torch checkpoint's tensors lie among the blocks of its block set (`Tier.TORCH`):
what a pipeline stage running some of its layers must hold before it starts (FaaScale §4.3).
A stage runs units: the decoder layers, then the head (the final norm and the output head),
so that a tied head, which is the embedding, can run on a node that holds the embedding.

The checkpoint's weights file is safetensors: an 8-byte header length, a JSON header naming
each tensor's byte range in the data that follows. Its offset in the set (the small files come
first, `hostcache.form_files`) and the header give each tensor's blocks; a layer's blocks are
those of its tensors.
"""

from __future__ import annotations

from pathlib import Path

from services.loader.blockset import BlockSet
from shared.artifact import EMBED, HEAD, TORCH_WEIGHTS, layer_of, safetensors_header
from shared.pipeline_messages import Span, StageLayout


def _merge(spans: list[Span]) -> tuple[Span, ...]:
    out: list[Span] = []
    for lo, hi in sorted(spans):
        if out and lo <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return tuple(out)


def stage_layout(root: Path, bs: BlockSet) -> StageLayout:
    """The layout of the checkpoint at `root` (the store's copy) in the block set `bs`."""
    at = 0
    for f in bs.files:
        if f.path == TORCH_WEIGHTS:
            break
        at += f.size
    else:
        raise ValueError(f"{bs.set_id} has no {TORCH_WEIGHTS}: not a torch checkpoint's block set")
    head_bytes, tensors = safetensors_header(root / TORCH_WEIGHTS)
    data = at + head_bytes

    def span(name: str) -> Span:
        lo, hi = tensors[name]["data_offsets"]
        return (data + lo) // bs.block_bytes, (data + max(lo, hi - 1)) // bs.block_bytes

    layers: dict[int, list[Span]] = {}
    head: list[Span] = []
    for name in tensors:
        i = layer_of(name)
        if i is not None:
            layers.setdefault(i, []).append(span(name))
        elif name != EMBED:
            head.append(span(name))  # the final norm, the head
    if sorted(layers) != list(range(len(layers))):
        raise ValueError(f"{bs.set_id}: the checkpoint's layers are not 0..{len(layers) - 1}")
    first = [span(EMBED)] if EMBED in tensors else []
    if HEAD not in tensors:  # a tied head: the stage running it reads the embedding
        head += first
    return StageLayout(
        blocks=bs.blocks,
        block_bytes=bs.block_bytes,
        lead=-(-data // bs.block_bytes),
        units=(*(_merge(v) for _, v in sorted(layers.items())), _merge(head)),
        first=_merge(first),
    )

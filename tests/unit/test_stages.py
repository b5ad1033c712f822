"""Which layers and tensors each stage of a pipelined model holds (FaaScale §4.3)."""

from __future__ import annotations

import pytest

pytest.importorskip("torch", reason="the torch engine needs torch")

from services.engine.torch_engine.stages import EMBED, HEAD, NORM, LayerRange, stage_tensors


def names(layers: int, tied: bool) -> list[str]:
    out = [EMBED]
    for i in range(layers):
        out += [f"model.layers.{i}.self_attn.q_proj.weight", f"model.layers.{i}.mlp.up_proj.weight"]
    return out + [NORM] + ([] if tied else [HEAD])


def test_a_range_must_lie_in_the_model_and_hold_a_layer_unless_it_is_the_head_alone() -> None:
    with pytest.raises(ValueError):
        LayerRange(3, 3, 4)
    with pytest.raises(ValueError):
        LayerRange(2, 5, 4)
    assert LayerRange(4, 4, 4, head=True).last and not LayerRange(0, 2, 4).last and LayerRange(2, 4, 4).last


def test_each_stage_holds_its_layers_renumbered_and_only_the_ends_hold_embedding_norm_and_head() -> None:
    first, middle, last = LayerRange(0, 2, 6), LayerRange(2, 4, 6), LayerRange(4, 6, 6)
    untied = names(6, tied=False)
    a, b, c = (stage_tensors(untied, r, tied=False) for r in (first, middle, last))
    assert a == {
        EMBED: EMBED,
        **{
            f"model.layers.{i}.{p}": f"model.layers.{i}.{p}"
            for i in (0, 1)
            for p in ("self_attn.q_proj.weight", "mlp.up_proj.weight")
        },
    }
    assert b == {
        f"model.layers.{i}.{p}": f"model.layers.{i - 2}.{p}"
        for i in (2, 3)
        for p in ("self_attn.q_proj.weight", "mlp.up_proj.weight")
    }
    assert set(c) == {
        f"model.layers.{i}.{p}" for i in (4, 5) for p in ("self_attn.q_proj.weight", "mlp.up_proj.weight")
    } | {NORM, HEAD}
    # Every tensor is in exactly one stage (none twice: each stage reads a disjoint part).
    assert sorted([*a, *b, *c]) == sorted(untied)


def test_a_tied_head_is_the_embedding_which_the_last_stage_reads_too() -> None:
    first, last = LayerRange(0, 2, 4), LayerRange(2, 4, 4)
    tied = names(4, tied=True)
    assert EMBED in stage_tensors(tied, first, tied=True)
    assert EMBED in stage_tensors(tied, last, tied=True) and HEAD not in stage_tensors(tied, last, tied=True)
    assert EMBED not in stage_tensors(tied, last, tied=False)

"""Which layers and tensors each stage of a pipelined model holds (FaaScale §4.3)."""

from __future__ import annotations

import pytest

pytest.importorskip("torch", reason="the torch engine needs torch")

from services.engine.torch_engine.stages import EMBED, HEAD, NORM, LayerRange, split, stage_tensors


def names(layers: int, tied: bool) -> list[str]:
    out = [EMBED]
    for i in range(layers):
        out += [f"model.layers.{i}.self_attn.q_proj.weight", f"model.layers.{i}.mlp.up_proj.weight"]
    return out + [NORM] + ([] if tied else [HEAD])


def test_a_split_covers_every_layer_once_in_near_equal_ranges() -> None:
    for layers in (1, 2, 7, 30):
        for stages in range(1, layers + 1):
            ranges = split(layers, stages)
            assert [r.lo for r in ranges[1:]] == [r.hi for r in ranges[:-1]]
            assert ranges[0].first and ranges[-1].last and ranges[-1].hi == layers
            sizes = [r.hi - r.lo for r in ranges]
            assert max(sizes) - min(sizes) <= 1
    with pytest.raises(ValueError):
        split(4, 5)
    with pytest.raises(ValueError):
        LayerRange(3, 3, 4)


def test_each_stage_holds_its_layers_renumbered_and_only_the_ends_hold_embedding_norm_and_head() -> None:
    first, middle, last = split(6, 3)
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
    first, last = split(4, 2)
    tied = names(4, tied=True)
    assert EMBED in stage_tensors(tied, first, tied=True)
    assert EMBED in stage_tensors(tied, last, tied=True) and HEAD not in stage_tensors(tied, last, tied=True)
    assert EMBED not in stage_tensors(tied, last, tied=False)

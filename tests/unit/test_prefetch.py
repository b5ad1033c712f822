"""TIDAL Eq. 1 and the access-order split of a cold start's copy: policy/prefetch.py."""

from __future__ import annotations

import pytest

from policy.prefetch import Layer, admission_bytes, plan_prefetch, prefetch_bytes

GB = 10**9


def test_the_papers_testbed_a_16_gb_model_over_32_gb_s_with_a_quarter_second_ttft() -> None:
    # TIDAL §7's first testbed: PCIe 4.0 at 32 GB/s; Llama3-8B's bf16 weights are ≈ 16 GB. In one
    # 0.25 s TTFT the link moves 8 GB, so only the other 8 GB must be resident ahead.
    assert prefetch_bytes(16 * GB, 0.25, 32 * GB) == 8 * GB


def test_a_model_the_link_moves_within_one_ttft_needs_nothing_ahead() -> None:
    # SmolLM2-135M in bf16 (≈ 270 MB) at a measured 50 GB/s moves in 5.4 ms: a 20 ms TTFT covers it.
    assert prefetch_bytes(270_000_000, 0.020, 50 * GB) == 0


def test_without_a_link_or_time_everything_is_copied_ahead() -> None:
    assert prefetch_bytes(5 * GB, 0.0, 32 * GB) == 5 * GB
    assert prefetch_bytes(5 * GB, 1.0, 0.0) == 5 * GB


def test_negative_inputs_are_refused() -> None:
    with pytest.raises(ValueError):
        prefetch_bytes(-1, 0.1, 1.0)


def layers(n: int, nbytes: int) -> list[Layer]:
    return [Layer("embed", nbytes), *(Layer(f"layer.{i}", nbytes) for i in range(n)), Layer("head", nbytes)]


def test_the_first_layers_in_access_order_are_copied_ahead_and_the_rest_streams() -> None:
    # 6 units of 1 GB, 2 s of TTFT at 2 GB/s moves 4 GB: the first 2 GB go ahead.
    plan = plan_prefetch(layers(4, GB), ttft_s=2.0, h2d_bytes_per_s=2 * GB)
    assert plan.target_bytes == 2 * GB
    assert plan.before_admit == ("embed", "layer.0")
    assert plan.streamed == ("layer.1", "layer.2", "layer.3", "head")
    assert (plan.before_admit_bytes, plan.streamed_bytes) == (2 * GB, 4 * GB)


def test_a_target_inside_a_layer_takes_the_whole_layer() -> None:
    plan = plan_prefetch(layers(2, 100), ttft_s=1.0, h2d_bytes_per_s=150)  # 400 − 150 = 250
    assert plan.target_bytes == 250
    assert plan.before_admit == ("embed", "layer.0", "layer.1")
    assert plan.before_admit_bytes == 300


def test_a_fast_link_streams_everything_and_a_dead_one_streams_nothing() -> None:
    fast = plan_prefetch(layers(3, 100), ttft_s=1.0, h2d_bytes_per_s=10**6)
    assert fast.before_admit == () and fast.streamed_bytes == 500
    dead = plan_prefetch(layers(3, 100), ttft_s=1.0, h2d_bytes_per_s=0)
    assert dead.streamed == () and dead.before_admit_bytes == 500


def test_a_gpu_start_is_admitted_at_m_prefetch_once_bandwidth_and_ttft_are_measured() -> None:
    # TIDAL's testbed figures again, through the copy engines beside the compute.
    assert admission_bytes(16 * GB, 0.25, 32 * GB, dma=True) == 8 * GB
    assert admission_bytes(16 * GB, None, 32 * GB, dma=True) is None  # no TTFT measured: all first
    assert admission_bytes(16 * GB, 0.25, 0.0, dma=True) is None  # no bandwidth measured


def test_a_host_arena_never_streams_its_copy_into_the_forward_pass() -> None:
    # The copy would take the forward pass's own cores: admitted whole, however fast.
    assert admission_bytes(16 * GB, 10.0, 32 * GB, dma=False) is None

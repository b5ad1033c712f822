import pytest

from policy.perf_model import (
    DecodeSample,
    PerfModel,
    PrefillSample,
    powers_of_two,
    profile,
)


def linear() -> PerfModel:
    return PerfModel.fit(
        [PrefillSample(512, 1.0), PrefillSample(1024, 2.0)],
        [DecodeSample(b, n, 0.01 * b + 0.0001 * n) for b in (1, 16) for n in (512, 2048)],
    )


def test_prefill_is_interpolated_between_the_two_closest_lengths() -> None:
    assert linear().prefill_s(768) == pytest.approx(1.5)


def test_prefill_beyond_the_samples_is_extended_not_clamped() -> None:
    assert linear().prefill_s(2048) == pytest.approx(4.0)


def test_decode_is_bilinear_in_batch_and_length() -> None:
    m = linear()
    assert m.decode_s(8, 1280) == pytest.approx(0.01 * 8 + 0.0001 * 1280)


def test_a_batch_beyond_the_grid_costs_more_than_the_largest_measured() -> None:
    m = linear()
    assert m.decode_s(32, 512) > m.decode_s(16, 512)


def test_a_missing_grid_cell_is_refused() -> None:
    with pytest.raises(ValueError):
        PerfModel.fit([PrefillSample(1, 1.0)], [DecodeSample(1, 1, 1.0), DecodeSample(2, 2, 1.0)])


def test_profiling_samples_powers_of_two_so_the_cost_is_logarithmic() -> None:
    assert powers_of_two(4096)[-1] == 4096 and len(powers_of_two(4096)) == 13
    measured: list[tuple[int, ...]] = []

    def prefill(n: int) -> float:
        measured.append((n,))
        return 0.001 * n

    def decode(b: int, n: int) -> float:
        measured.append((b, n))
        return 0.05

    profile(prefill, decode, max_length=4096, max_batch=256)
    assert len(measured) == 13 + 13 * 9  # "only a few hundred samples" (§5.2)


def test_a_profiled_model_reproduces_the_measured_points() -> None:
    m = profile(lambda n: 0.001 * n, lambda b, n: 0.05 + 0.002 * b + 1e-6 * b * n)
    assert m.prefill_s(1024) == pytest.approx(1.024)
    assert m.decode_s(16, 1024) == pytest.approx(0.05 + 0.032 + 1e-6 * 16 * 1024)


def test_max_batch_is_the_largest_within_the_tpot_slo() -> None:
    m = profile(lambda n: 0.001 * n, lambda b, n: 0.05 + 0.01 * b)
    assert m.max_batch(1024, 0.25) == 20

import numpy as np

from services.engine.sampling import Sampler

LOGITS = np.array([0.1, 3.0, 2.9, -1.0, 0.5], dtype=np.float32)


def test_temperature_zero_is_greedy() -> None:
    assert Sampler(0.0, 1.0, None).pick(LOGITS) == 1


def test_same_seed_same_samples() -> None:
    a, b = Sampler(1.0, 1.0, 42), Sampler(1.0, 1.0, 42)
    assert [a.pick(LOGITS) for _ in range(20)] == [b.pick(LOGITS) for _ in range(20)]


def test_tiny_top_p_keeps_only_the_most_likely_token() -> None:
    s = Sampler(1.0, 1e-6, 1)
    assert {s.pick(LOGITS) for _ in range(50)} == {1}


def test_top_p_keeps_the_nucleus_only() -> None:
    # Tokens 1 and 2 carry ~0.9 of the mass at temperature 1: top_p 0.8 never picks the rest.
    s = Sampler(1.0, 0.8, 3)
    assert {s.pick(LOGITS) for _ in range(200)} <= {1, 2}


def test_sampling_follows_the_distribution() -> None:
    s = Sampler(1.0, 1.0, 5)
    picks = [s.pick(LOGITS) for _ in range(2000)]
    p = np.exp(LOGITS - LOGITS.max())
    p /= p.sum()
    assert abs(picks.count(1) / 2000 - p[1]) < 0.05

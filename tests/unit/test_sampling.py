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


def test_logit_bias_bans_and_forces_tokens() -> None:
    assert Sampler(0.0, 1.0, None, logit_bias=[(1, -100.0)]).pick(LOGITS) == 2
    assert Sampler(0.0, 1.0, None, logit_bias=[(3, 100.0)]).pick(LOGITS) == 3
    sampled = Sampler(1.0, 1.0, 9, logit_bias=[(1, -100.0), (2, -100.0)])
    assert all(sampled.pick(LOGITS) not in (1, 2) for _ in range(200))


def test_frequency_and_presence_penalties_count_the_completions_tokens() -> None:
    s = Sampler(0.0, 1.0, None, frequency_penalty=0.2)
    assert [s.pick(LOGITS) for _ in range(2)] == [1, 2]  # 3.0 - 0.2 < 2.9 once 1 was picked
    p = Sampler(0.0, 1.0, None, presence_penalty=3.0)
    assert [p.pick(LOGITS) for _ in range(3)] == [1, 2, 4]


def test_top_k_and_min_p_keep_only_the_likely_tokens() -> None:
    k = Sampler(1.0, 1.0, 3, top_k=2)
    assert {k.pick(LOGITS) for _ in range(300)} == {1, 2}
    m = Sampler(1.0, 1.0, 3, min_p=0.5)  # p(2)/p(1) = e^-0.1 > 0.5; the rest far below
    assert {m.pick(LOGITS) for _ in range(300)} == {1, 2}


def test_token_logprob_is_the_log_softmax_and_its_top_is_sorted() -> None:
    from services.engine.sampling import token_logprob

    e = token_logprob(LOGITS, 2, top=3)
    z = LOGITS.astype(np.float64)
    log_p = z - np.log(np.exp(z).sum())
    assert e.token == 2 and abs(e.logprob - log_p[2]) < 1e-9
    assert [t for t, _ in e.top] == [1, 2, 4]
    assert all(abs(lp - log_p[t]) < 1e-9 for t, lp in e.top)
    assert token_logprob(LOGITS, 1, top=0).top == ()


def test_greedy_is_decided_once_below_the_sampling_epsilon_for_params_and_samplers_alike() -> None:
    from services.engine.sampling import SAMPLING_EPS, is_greedy
    from shared.messages import SamplingParams

    logits = np.array([0.0, 1.0, 0.5], dtype=np.float32)
    tiny = SamplingParams(max_tokens=4, temperature=SAMPLING_EPS / 2)
    assert is_greedy(tiny) and is_greedy(Sampler.of(tiny)) and Sampler.of(tiny).pick(logits) == 1
    warm = SamplingParams(max_tokens=4, temperature=SAMPLING_EPS)
    assert not is_greedy(warm) and not is_greedy(Sampler.of(warm))


def test_token_logprob_orders_tied_alternatives_as_greedy_decoding_chooses() -> None:
    """Under greedy decoding the chosen token is the first alternative, ties included (argmax
    takes the lowest id; a low-precision model's logits tie often)."""
    from services.engine.sampling import Sampler, token_logprob

    logits = np.random.default_rng(0).standard_normal(1000).astype(np.float32)
    logits[[848, 203, 520]] = logits.max() + 1  # three tied at the top
    token = Sampler(0.0, 1.0, None).pick(logits)
    assert token == 203
    for top in (1, 2, 3, 5):
        e = token_logprob(logits, token, top)
        assert [t for t, _ in e.top][: min(top, 3)] == [203, 520, 848][: min(top, 3)]
        assert len(e.top) == top

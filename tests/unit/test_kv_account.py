"""An instance's KV reservation under the watermark rule (policy/kv_account.py)."""

from __future__ import annotations

from policy.kv_account import KvAccount
from policy.kv_watermark import Action

C = 10  # bytes per token


def account(min_tokens: int = 100, reserved_tokens: int = 100) -> KvAccount:
    return KvAccount(per_token_bytes=C, min_tokens=min_tokens, watermark=0.2, reserved_bytes=C * reserved_tokens)


def test_a_quiet_instance_holds_the_floor_and_a_small_request_fits_in_it() -> None:
    kv = account()
    assert kv.required() == C * 100
    assert kv.admit("a", input_tokens=40, cap=20, available=0).action is Action.KEEP


def test_a_request_that_does_not_fit_grows_the_cache_early_to_the_watermark() -> None:
    kv = account()
    kv.admit("a", 60, 10, available=10**6)
    plan = kv.admit("b", 60, 10, available=10**6)
    # Eq. 2 with Ō = 0 (nothing completed yet): 60 + 60 tokens; recommended 1.2 × 120.
    assert plan.action is Action.GROW and plan.target_bytes == C * 144


def test_when_only_the_requirement_fits_it_compromises() -> None:
    kv = account()
    kv.admit("a", 60, 10, available=0)
    plan = kv.admit("b", 60, 10, available=C * 30)
    assert plan.action is Action.GROW_COMPROMISED and plan.target_bytes == C * 120


def test_the_mean_output_of_completed_requests_counts_for_running_ones_up_to_their_cap() -> None:
    kv = account(min_tokens=0)
    for i, out in enumerate((30, 50)):  # Ō = 40
        kv.admit(str(i), 10, 100, available=10**6)
        kv.complete(str(i), out)
    assert kv.mean_output == 40
    kv.admit("long", 10, 100, available=10**6)
    kv.admit("short", 10, 5, available=10**6)  # can never reach Ō: capped at 5
    assert kv.required() == C * ((10 + 40) + (10 + 5))


def test_a_cancelled_request_says_nothing_about_output_lengths() -> None:
    kv = account()
    kv.admit("a", 10, 100, available=0)
    kv.complete("a", 3, finished=False)
    assert kv.mean_output == 0 and kv.completed == 0 and not kv.running


def test_a_request_past_the_mean_grows_the_cache_only_once_it_outgrows_it() -> None:
    kv = account(min_tokens=0, reserved_tokens=60)
    kv.admit("a", 50, 1000, available=0)
    assert kv.progress("a", 10, available=10**6).action is Action.KEEP  # 60 tokens: fits
    plan = kv.progress("a", 20, available=10**6)
    assert plan.action is Action.GROW and plan.target_bytes == C * 84  # 1.2 × 70


def test_the_cache_shrinks_lazily_once_requests_have_left() -> None:
    kv = account(min_tokens=100, reserved_tokens=144)
    kv.admit("a", 60, 10, available=0)
    kv.admit("b", 60, 10, available=0)
    assert kv.complete("a", 10).action is Action.KEEP  # needs 130 (Ō = 10): no shrink yet
    plan = kv.complete("b", 10)
    # Floor 100 → recommended 120; 120 × 1.2 = 144 is not below 144: still kept.
    assert plan.action is Action.KEEP
    kv.reserved_bytes = C * 200
    kv.admit("c", 10, 10, available=0)
    plan = kv.complete("c", 10)
    assert plan.action is Action.SHRINK and plan.target_bytes == C * 120


def test_when_even_the_requirement_is_refused_the_request_with_most_headroom_is_evicted() -> None:
    # §6.4. Same SLOs (TTFT 1 s, TPOT 0.1 s); at t = 10: "early" arrived at 0 and has 30
    # tokens (headroom 0 + 1 + 3 - 10 = -6 s), "late" arrived at 8 with 5 (8 + 1 + 0.5 - 10 =
    # -0.5 s), "fresh" at 9.5 with none (0.5 s): the fresh one can best afford to go elsewhere.
    kv = account()
    for rid, received, generated in (("early", 0.0, 30), ("late", 8.0, 5), ("fresh", 9.5, 0)):
        kv.admit(rid, 40, 200, available=0, received_at=received)
        kv.progress(rid, generated, available=0)
    assert kv.evictee(1.0, 0.1, now=10.0) == "fresh"
    # A tighter TPOT SLO weighs tokens less: "late" (8 + 1 + 0.05 - 10) still trails "fresh".
    assert kv.evictee(1.0, 0.01, now=10.0) == "fresh"
    kv.forget("fresh")
    assert kv.evictee(1.0, 0.1, now=10.0) == "late"
    # Alone, a request is not evicted: that frees nothing for anyone on this instance.
    kv.forget("late")
    assert kv.evictee(1.0, 0.1, now=10.0) is None


def test_a_long_prompt_s_own_ttft_slo_gives_it_the_headroom_it_earned() -> None:
    """Each request's headroom counts its own TTFT SLO (it grows with the prompt, LLM-Mesh
    §8.1): a 4,096-token prompt received at 0 has max(1, 4096/512) = 8 s, so at t = 5 with
    no token yet its headroom is 3 s, more than a short one received at 4.5 (0.5 s)."""
    kv = account()
    kv.admit("long", 4096, 10, available=0, received_at=0.0, ttft_slo_s=8.0)
    kv.admit("short", 40, 10, available=0, received_at=4.5, ttft_slo_s=1.0)
    assert kv.evictee(1.0, 0.1, now=5.0) == "long"
    # With the model's fixed 1 s for both, the long one would look 4 s late and stay.
    fixed = account()
    fixed.admit("long", 4096, 10, available=0, received_at=0.0)
    fixed.admit("short", 40, 10, available=0, received_at=4.5)
    assert fixed.evictee(1.0, 0.1, now=5.0) == "short"

import pytest

from policy.tensor_pool import Tensor, TensorPool


def pool(cap: int = 100) -> TensorPool:
    return TensorPool(cap, bandwidth_bps=10.0)


def test_a_released_models_tensors_stay_resident_and_are_reused() -> None:
    p = pool()
    a = (Tensor("a.0", 30), Tensor("a.1", 20))
    assert p.acquire("a", a, now=0.0).loaded_bytes == 50
    p.release("a", now=1.0)
    assert p.idle_bytes == 50
    again = p.acquire("a", a, now=2.0)
    assert again.reused_bytes == 50 and again.loaded_bytes == 0 and p.idle_bytes == 0


def test_fine_tunes_share_their_base_tensors() -> None:
    p = pool()
    p.acquire("base", (Tensor("base", 40),), 0.0)
    p.release("base", 1.0)
    got = p.acquire("ft", (Tensor("base", 40), Tensor("ft.lora", 5)), 2.0)
    assert got.reused_bytes == 40 and got.loaded_bytes == 5


def test_idle_tensors_are_evicted_by_tangram_cost_when_memory_runs_short() -> None:
    p = pool(100)
    p.acquire("hot", (Tensor("hot", 40),), 0.0)
    for t in range(1, 20):
        p.release("hot", float(t))
        p.acquire("hot", (Tensor("hot", 40),), float(t))
    p.release("hot", 20.0)
    p.acquire("cold", (Tensor("cold", 40),), 0.0)
    p.release("cold", 0.0)
    got = p.acquire("new", (Tensor("new", 50),), 21.0)
    assert got is not None and got.evicted == ("cold",)
    assert "hot" in p.residents


def test_tensors_in_use_are_never_evicted() -> None:
    p = pool(100)
    p.acquire("a", (Tensor("a", 60),), 0.0)
    assert p.acquire("b", (Tensor("b", 60),), 1.0) is None
    assert p.used_bytes == 60


def test_kv_is_allocated_on_demand_and_reclaims_idle_tensors() -> None:
    p = pool(100)
    p.acquire("a", (Tensor("a", 60),), 0.0)
    p.release("a", 0.0)
    p.acquire("b", (Tensor("b", 30),), 1.0)
    assert p.grow_kv("b", 50, 2.0) == ("a",)
    p.shrink_kv("b", 50)
    assert p.used_bytes == 30 and p.grow_kv("b", 80, 3.0) is None


def test_an_abandoned_acquire_leaves_what_it_reused_and_forgets_what_it_never_loaded() -> None:
    p = pool(100)
    p.acquire("base", (Tensor("base", 40),), 0.0)
    p.release("base", 1.0)
    p.acquire("ft", (Tensor("base", 40), Tensor("ft.own", 10)), 2.0)
    p.abandon("ft", ["ft.own"])  # its memory could not be laid out
    assert "ft" not in p.active and "ft.own" not in p.residents
    assert p.used_bytes == 40 and p.idle_bytes == 40  # the base is resident and idle again


def test_an_idle_tensor_can_be_dropped_and_one_in_use_cannot() -> None:
    p = pool(100)
    p.acquire("a", (Tensor("a", 30),), 0.0)
    with pytest.raises(ValueError):
        p.drop("a")
    p.release("a", 1.0)
    p.drop("a")
    assert p.used_bytes == 0 and p.idle_bytes == 0 and not p.residents

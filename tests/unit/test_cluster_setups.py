"""Setup (b) of the cluster bench (`bench.cluster_setups.MANY`): many models, Azure-skewed,
tails that come and go; and `bench.cluster --sim-only`'s `setups` report."""

import json
from collections import Counter
from itertools import pairwise
from pathlib import Path

import pytest

from bench import cluster
from bench.cluster import main
from bench.cluster_setups import MANY, MANY_COUNT, THREE, Load

KEEP_ALIVE_S = 30.0
LOAD = Load(MANY.seed, MANY.duration_s, 6, 0.5, MANY.ramp_s, MANY)


def test_the_many_model_plan_is_one_for_a_seed_and_another_for_another() -> None:
    rate = MANY.start_rate(6)
    assert LOAD.plan(rate) == LOAD.plan(rate)
    other = Load(MANY.seed + 1, MANY.duration_s, 6, 0.5, MANY.ramp_s, MANY)
    assert other.plan(rate) != LOAD.plan(rate)


def test_every_model_is_called_and_each_is_a_distinct_artifact() -> None:
    plan = LOAD.plan(MANY.start_rate(6))
    assert len(MANY.models) == MANY_COUNT >= 12
    assert {name for _, name in plan} == {m.name for m in MANY.models}
    assert len({m.suffix for m in MANY.models}) == MANY_COUNT and all(m.suffix for m in MANY.models)
    assert len({(m.ttft_slo_s, m.tpot_slo_s) for m in MANY.models}) == 3  # a mix of SLOs


def test_popularity_is_skewed() -> None:
    counts = Counter(name for _, name in LOAD.plan(3.0)).most_common()
    hottest, tail = counts[0][1], counts[-1][1]
    assert hottest >= 5 * tail
    assert sum(c for _, c in counts[:3]) >= 0.4 * sum(c for _, c in counts)  # a few carry much of it


def test_the_tail_comes_and_goes_past_the_keep_alive() -> None:
    plan = LOAD.plan(3.0)
    span = LOAD.ramp_s + LOAD.duration_s
    gaps = {}
    for m in MANY.models:
        times = [0.0, *(t for t, name in plan if name == m.name), span]
        gaps[m.name] = max(b - a for a, b in pairwise(times))
    # Most models are idle past their keep-alive at some point: exclusive must stop and restart them.
    assert sum(g > KEEP_ALIVE_S for g in gaps.values()) >= MANY_COUNT // 2


def test_the_rate_scales_the_load_and_keeps_its_shape() -> None:
    low, high = LOAD.plan(1.5), LOAD.plan(6.0)
    assert 3 * len(low) <= len(high) <= 5 * len(low)
    top = Counter(n for _, n in high).most_common(1)[0][0]
    assert top == Counter(n for _, n in low).most_common(1)[0][0]


def test_setup_a_is_unchanged() -> None:
    assert [m.name for m in THREE.models] == ["chat", "assist", "batch"]
    assert (THREE.seed, THREE.duration_s, THREE.ramp_s) == (1, 40.0, 20.0)


def test_sim_only_writes_the_setups_format_and_keeps_the_others(tmp_path: Path) -> None:
    (tmp_path / "cluster.json").write_text(json.dumps({"setups": {"three": {"real": {"kept": True}}}, "old": 1}))
    argv = ["--setup", "many", "--sim-only", "--duration", "20", "--ramp", "10", "--steps", "0", "--out", str(tmp_path)]
    assert main(argv) == 0
    report = json.loads((tmp_path / "cluster.json").read_text())
    assert report["old"] == 1 and report["setups"]["three"] == {"real": {"kept": True}}
    many = report["setups"]["many"]
    assert many["nodes"] == 3 and [m["name"] for m in many["models"]] == [m.name for m in MANY.models]
    assert many["real"] is None
    sim = many["sim"]
    assert set(sim["capacity_req_per_s"]) == set(sim["curves"]) == {"tessera", "exclusive"}
    assert "capacity_ratio_vs_exclusive" in sim
    assert (tmp_path / "cluster.png").exists() is plots()


def test_a_real_run_of_setup_b_lands_beside_its_simulation(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The real path's bookkeeping, the cluster stubbed out: what the other engineer's run writes.
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    monkeypatch.setattr(cluster, "default_model_path", lambda: gguf)
    monkeypatch.setattr(cluster, "prepare_store", lambda *a: None)

    def run_policy(variant: str, *_: object) -> dict[str, object]:
        cap = {"tessera": 6.0, "exclusive": 2.0}[variant]
        point = {"rate_req_per_s": cap, "slo_attainment": 1.0, "slo_attainment_ci95": (0.9, 1.0), "results": []}
        return {"policy": variant, "capacity_req_per_s": cap, "cold_starts": 1, "tiers_before": {}, "points": [point]}

    monkeypatch.setattr(cluster, "run_policy", run_policy)
    argv = ["--setup", "many", "--duration", "20", "--ramp", "10", "--steps", "0", "--out", str(tmp_path)]
    assert cluster.main(argv) == 0
    report = json.loads((tmp_path / "cluster.json").read_text())
    assert "capacity_req_per_s" not in report  # the top-level keys are setup (a)'s
    many = report["setups"]["many"]
    assert many["real"]["capacity_ratio_vs_exclusive"] == 3.0 and many["real"]["runs"]
    assert many["sim"]["capacity_req_per_s"]["tessera"] > 0
    assert (tmp_path / "cluster.png").exists() is plots()


def plots() -> bool:
    """Whether the bench's plots are drawn here: matplotlib is the `bench` extra's, which
    `make test`'s environment lacks (the JSON is written either way)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True

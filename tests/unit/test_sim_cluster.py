"""The simulator on `bench.cluster`'s setup (`bench.sim.real_cluster`): per-model SLOs, the real
bench's exclusive baseline, its judgement and ramp, and the node fitted from measurements."""

from dataclasses import replace
from pathlib import Path

import pytest

from bench.cluster import MODELS, Load
from bench.sim.fit import Timed, decode_points, fit_step, fitted_hardware
from bench.sim.hardware import GB
from bench.sim.real_cluster import (
    EXCLUSIVE_CLUSTER,
    TESSERA_CLUSTER,
    ClusterSetup,
    capacity,
    cluster_trace,
    run_at,
)
from bench.sim.simulator import Sim, met_as_benched
from bench.sim.state import Req

NODE = fitted_hardware(
    "cpu",
    prefill_tok_s=1000.0,
    step=(0.018, 0.0022),
    memory_bytes=4 * GB,
    load_bps=0.6 * GB,
    init_s=0.0,
    kv_copy_bps=20 * GB,
)
SMALL = ClusterSetup(Load(seed=3, duration_s=12.0, burst=6, spread_s=0.5, ramp_s=6.0), steps=1)


def test_a_requests_slos_are_its_models() -> None:
    sim = Sim(cluster_trace(SMALL.load, 4.0), 3, 0, TESSERA_CLUSTER, SMALL.testbed(NODE))
    sim.run()
    by_name = {m.name: m for m in MODELS}
    assert {sim.models[r.model].name for r in sim.reqs} == set(by_name)
    for r in sim.reqs:
        model = by_name[sim.models[r.model].name]
        assert r.ttft == model.ttft_slo_s and r.tpot == model.tpot_slo_s


def test_the_real_benchs_exclusive_baseline_never_scales_out() -> None:
    # Far past one node's capacity: the LLM-Mesh baseline would start more instances of chat.
    sim = Sim(cluster_trace(SMALL.load, 30.0), 3, 0, EXCLUSIVE_CLUSTER, SMALL.testbed(NODE))
    st = sim.run()
    assert st.cold_starts == len(MODELS)
    served = {r.inst.node.nid for r in sim.reqs if r.inst is not None and sim.models[r.model].name == "chat"}
    assert len(served) == 1
    assert st.attainment < 0.95  # the queue on the one node: the test has teeth


def test_only_requests_after_the_ramp_count() -> None:
    trace = cluster_trace(SMALL.load, 3.0)
    st = run_at(SMALL, TESSERA_CLUSTER, NODE, 3.0)
    assert st.requests == int((trace.arrival >= SMALL.load.ramp_s).sum()) < len(trace)


def test_one_seed_gives_one_capacity() -> None:
    a = capacity(SMALL, EXCLUSIVE_CLUSTER, NODE)
    b = capacity(SMALL, EXCLUSIVE_CLUSTER, NODE)
    assert a == b and a[0] > 0


def test_the_benchs_judgement_is_mean_tpot_not_eq1() -> None:
    # A fast first token lends eq. 1 slack that `bench.cluster`'s mean TPOT does not.
    r = Req(0, 0, 0.0, 40, 32, 1.5, 0.25)
    r.first, r.done = 0.1, 0.1 + 31 * 0.27
    assert not met_as_benched(r)
    r.done = 0.1 + 31 * 0.25
    assert met_as_benched(r)
    late = run_at(SMALL, TESSERA_CLUSTER, NODE, 30.0).attainment
    lenient = run_at(replace(SMALL, mean_tpot=False), TESSERA_CLUSTER, NODE, 30.0).attainment
    assert lenient >= late


def test_the_fit_recovers_a_nodes_step_line() -> None:
    # Requests served one after another (batch 1), then four at once (batch 4), no prefills
    # inside anyone's window: the points are (1, a + c) and (4, a + 4c).
    a, c = 0.02, 0.003
    alone = [Timed(10.0 * i, 10.0 * i, 10.0 * i + 31 * (a + c), 32) for i in range(3)]
    crowd = [Timed(100.0, 100.0, 100.0 + 31 * (a + 4 * c), 32) for _ in range(4)]
    points = decode_points(alone + crowd, prefill_s=0.05)
    assert sorted({round(b, 6) for b, _ in points}) == [1.0, 4.0]
    assert fit_step(points) == pytest.approx((a, c))


def test_a_node_is_fitted_from_its_own_runs_requests_beside_each_other_and_cold_starts() -> None:
    """Requests at capacity with their nodes: on node-0 one model alone (k = 1, one row), then
    two models with a row each (k = 2, rows 2); on node-1 one model with three rows (k = 1,
    rows 3). Each window's seconds per token is a·k + c·rows, so the fit recovers a and c; the
    cold-start records (an adapter's left out) give the start's load and fixed part; the
    prefill rate is the base fit's. A run without nodes gives no fit (the caller falls back)."""
    from bench.sim.real_cluster import WEIGHT_BYTES, NodeFit, fit_from_run

    a, c, n = 0.04, 0.015, 32

    def req(at: float, model: str, node: str, k: int, rows: int) -> dict[str, object]:
        tpot = a * k + c * rows
        return {"at_s": at, "ttft_s": 0.0, "tpot_s": tpot, "tokens": n, "ok": True, "model": model, "node": node}

    alone = [req(100.0 * i, "m0", "node-0", 1, 1) for i in range(3)]
    pair = [req(1000.0, m, "node-0", 2, 2) for m in ("m0", "m1")]
    crowd = [req(2000.0, "m2", "node-1", 1, 3) for _ in range(3)]

    def start(total: float, load: float, prefill: float, tier: str = "start") -> dict[str, object]:
        phases = {"init_s": 0.1, "load_s": load, "profile_s": 0.0, "prefill_s": prefill, "apply_s": 0.0}
        return {"total_s": total, "phases": phases, "tier": tier}

    runs = [
        {"cold_start_records": [start(3.0, 0.5, 0.5), start(5.0, 1.0, 1.0), start(0.1, 0.0, 0.05, tier="adapter")]},
        {"cold_start_records": [start(4.0, 0.75, 0.25)]},
    ]
    base = NodeFit(
        400.0,
        0.0,
        0.0,
        0,
        0.0,
        fitted_hardware(
            "cpu", prefill_tok_s=400.0, step=(0.0, 0.0), memory_bytes=GB, load_bps=1.0, init_s=0.0, kv_copy_bps=1.0
        ),
    )
    result = {"runs": runs, "requests_at_capacity": {"tessera": [*alone, *pair, *crowd], "exclusive": alone}}
    fit = fit_from_run(result, base)
    assert fit is not None and fit.points == 11
    assert fit.step_fixed_s == pytest.approx(a) and fit.step_per_row_s == pytest.approx(c)
    assert fit.prefill_tok_s == 400.0
    # Medians of (0.5, 1.0, 0.75) and of total − load − a 40-token prompt at 400 tok/s: (2.4, 3.9, 3.15).
    assert fit.load_s == 0.75 and fit.start_fixed_s == pytest.approx(3.15)
    assert abs(fit.hardware.load_bps - WEIGHT_BYTES / 0.75) < 1e-6 and fit.hardware.init_s == pytest.approx(3.15)
    unplaced = {"runs": runs, "requests_at_capacity": {"tessera": [{**r, "node": None} for r in alone * 4]}}
    assert fit_from_run(unplaced, base) is None


def test_each_requests_node_is_read_from_the_schedulers_placements(tmp_path: Path) -> None:
    from bench.cluster import placed_on

    log = tmp_path / "scheduler.log"
    lines = [
        "{\"message\": \"placed 0a1b (40 prompt tokens): StartOn(node_id='node-1', why=''), predicted None\"}",
        '{"message": "placed 0a1b (40 prompt tokens): UseNode(node_id=\'node-2\', scale_out_to=None)"}',
        '{"message": "placed ffee (41 prompt tokens): NoRoom(otherwise=UseNode(node_id=\'node-0\', x=1))"}',
        '{"message": "scaled m00-chat to zero on node-1"}',
    ]
    log.write_text("\n".join(lines) + "\n")
    assert placed_on(log) == {"0a1b": "node-2", "ffee": "node-0"}  # placed again: the last wins
    assert placed_on(tmp_path / "none.log") == {}


def test_a_request_with_no_room_waits_in_the_line_and_is_still_served() -> None:
    # Far past capacity: the services' scheduler holds what no node has room for in its line
    # (for up to its TTFT SLO) and places it as room shows or its wait ends; nothing is lost.
    trace = cluster_trace(SMALL.load, 30.0)
    lined = Sim(trace, 3, 0, TESSERA_CLUSTER, SMALL.testbed(NODE))
    st = lined.run()
    assert st.lined > 0 and st.unfinished == 0
    assert st.met + st.late + st.rejected == st.requests
    waited = [r for r in lined.reqs if r.first >= 0 and r.first - r.arrival > r.ttft]
    assert all(r.outcome == "late" for r in waited)
    at_once = Sim(trace, 3, 0, replace(TESSERA_CLUSTER, line=False), SMALL.testbed(NODE)).run()
    assert at_once.lined == 0 and at_once.unfinished == 0


def test_resident_and_loading_starts_are_fitted_apart_the_load_from_a_node_doing_nothing_else() -> None:
    """Three resident starts in four made the mix's median load 0 s (loads free in the
    simulator): the fixed part is the resident starts' median, the load the other starts'
    median past it, measured in the exclusive run (its node ran nothing else; Tessera's
    loads beside busy instances took ten times as long, which the simulator makes of the
    load on the node's cores itself)."""
    from bench.sim.real_cluster import NodeFit, fit_from_run

    def req(at: float, node: str) -> dict[str, object]:
        return {"at_s": at, "ttft_s": 0.0, "tpot_s": 0.05, "tokens": 32, "ok": True, "model": "m0", "node": node}

    def start(total: float, source: str) -> dict[str, object]:
        phases = {"init_s": 0.0, "load_s": 0.0 if source == "resident" else 0.4, "profile_s": 0.0, "prefill_s": 0.1}
        return {"total_s": total, "phases": phases, "tier": "steady", "source": source}

    tessera = [start(t, "resident") for t in (0.2, 0.3, 0.4)] + [start(t, "store") for t in (6.0, 8.0, 10.0)]
    exclusive = [start(0.3, "resident"), start(0.9, "store"), start(1.1, "store"), start(1.3, "store")]
    runs = [
        {"policy": "tessera", "cold_start_records": tessera},
        {"policy": "exclusive", "cold_start_records": exclusive},
    ]
    base_hw = fitted_hardware(
        "cpu", prefill_tok_s=400.0, step=(0.0, 0.0), memory_bytes=GB, load_bps=1.0, init_s=0.0, kv_copy_bps=1.0
    )
    base = NodeFit(400.0, 0.0, 0.0, 0, 0.0, base_hw)
    requests = [req(100.0 * i, f"node-{i % 3}") for i in range(12)]
    fit = fit_from_run({"runs": runs, "requests_at_capacity": {"tessera": requests}}, base)
    assert fit is not None
    # Less a 40-token prompt at 400 tok/s (0.1 s): resident 0.1, 0.2, 0.3, 0.2 → 0.2; the
    # exclusive run's loads 0.8, 1.0, 1.2 less it → 0.8 (Tessera's 5.7-9.7 left out).
    assert fit.start_fixed_s == pytest.approx(0.2) and fit.load_s == pytest.approx(0.8)
    assert fit.hardware.init_s == pytest.approx(0.2) and fit.hardware.loads_on_node
    # Without an exclusive run, every loading start counts.
    alone = fit_from_run({"runs": runs[:1], "requests_at_capacity": {"tessera": requests}}, base)
    assert alone is not None and alone.load_s == pytest.approx(7.7)


def test_a_start_loads_on_its_nodes_cores_and_its_neighbour_waits_for_it() -> None:
    """On a CPU node (`Hardware.loads_on_node`) a start's load is laid on the node's timeline
    as a prefill is: decode pauses in it, so a request decoding beside it ends that much
    later; priced as a copy beside the compute (a GPU's), it does not wait."""
    import numpy as np

    from bench.cluster_setups import THREE_MODELS
    from bench.sim.real_cluster import WEIGHT_BYTES, cluster_models
    from bench.trace import Trace

    # One node: a long request of the first model, then the second model's first request
    # while it decodes (its start loads for 1 s), both within their SLOs.
    trace = Trace(
        cluster_models(THREE_MODELS[:2]),
        20.0,
        np.array([0.0, 1.0]),
        np.array([0, 1]),
        np.array([40, 40]),
        np.array([200, 8]),
    )
    slow = replace(NODE, load_bps=WEIGHT_BYTES / 1.0)
    runs = {}
    for on_node in (True, False):
        sim = Sim(trace, 1, 0, TESSERA_CLUSTER, SMALL.testbed(replace(slow, loads_on_node=on_node)))
        assert sim.run().cold_starts == 2
        runs[on_node] = sim.reqs
    long_beside, long_apart = runs[True][0], runs[False][0]
    assert long_beside.done == pytest.approx(long_apart.done + 1.0)
    # The second start's load queued behind the prefill queued before it (the long request's
    # first, 40 tokens at 1,000 tok/s, ending 0.04 s after the second's arrival).
    assert runs[True][1].first == pytest.approx(runs[False][1].first + 0.04)

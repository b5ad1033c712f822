from bench.sim import EXCLUSIVE, GPU_ONLY, TESSERA, Sim, simulate
from bench.trace import generate


def test_the_trace_is_seeded_and_heavy_tailed() -> None:
    a = generate(3, 16, 120.0, 2.0)
    b = generate(3, 16, 120.0, 2.0)
    assert (a.arrival == b.arrival).all() and (a.model == b.model).all()
    counts = sorted((a.model == m).sum() for m in range(16))
    assert counts[-1] >= 4 * max(counts[len(counts) // 2], 1)


def test_every_request_is_accounted_for_under_every_policy() -> None:
    trace = generate(5, 12, 60.0, 1.5)
    for policy in (TESSERA, EXCLUSIVE, GPU_ONLY):
        sim = Sim(trace, 2, 2, policy)
        st = sim.run()
        outcomes = {r.outcome for r in sim.reqs}
        assert outcomes <= {"met", "late", "rejected"}, (policy.name, outcomes)
        assert st.met + st.late + st.rejected + st.unfinished == st.requests == len(trace)
        assert st.unfinished == 0


def test_shadow_validation_agrees_with_execution() -> None:
    # The scheduler's placement (`policy.place`) predicts the nodes' prefill-first continuous
    # batching with their perf models and 10% to spare: a request it admits seldom misses, on
    # CPU or GPU, even past the cluster's capacity (it refuses what it cannot place in time).
    # What it cannot see: a prompt's own KV growth, and lengths growing while they decode.
    trace = generate(7, 16, 240.0, 4.0)
    sim = Sim(trace, 2, 2, TESSERA)
    st = sim.run()
    assert st.served_on.get("cpu", 0) > 0 and st.served_on.get("gpu", 0) > 0
    assert st.rejected > 0.05 * st.requests  # past capacity: the test has teeth
    assert st.late <= 0.01 * (st.requests - st.rejected), st.late_on


def test_cpu_nodes_add_capacity_over_gpu_only() -> None:
    # Around the GPU nodes' limit the CPU nodes take what validates there (3B models mostly)
    # and the requests they take meet their SLOs.
    trace = generate(3, 16, 240.0, 10.0)
    both = simulate(trace, 2, 2, TESSERA)
    gpu = simulate(trace, 2, 2, GPU_ONLY)
    assert both.met > gpu.met
    cpu = both.served_on.get("cpu", 0)
    assert cpu > 0 and both.late_on.get("cpu", 0) <= 0.01 * cpu


def test_sharing_beats_exclusive_when_models_outnumber_nodes() -> None:
    trace = generate(3, 24, 60.0, 0.5)  # 24 models on 4 nodes
    shared = simulate(trace, 2, 2, TESSERA)
    exclusive = simulate(trace, 2, 2, EXCLUSIVE)
    assert shared.attainment > exclusive.attainment


def test_an_idle_model_restarts_from_its_resident_tensors() -> None:
    trace = generate(11, 6, 120.0, 0.3)
    st = simulate(trace, 1, 1, GPU_ONLY)
    assert st.reuse_starts > 0


def test_cells_partition_the_trace_and_their_stats_add_up() -> None:
    from bench.sim import ScaleJob, cell_trace, merge, scale_run

    trace = generate(5, 12, 60.0, 3.0)
    cells = [cell_trace(trace, c, 3) for c in range(3)]
    assert sum(len(c) for c in cells) == len(trace)
    assert sorted(x for c in cells for x in c.arrival.tolist()) == sorted(trace.arrival.tolist())
    assert cells[1].models == trace.models[1::3] and set(cells[1].model.tolist()) <= set(range(4))
    one = simulate(cells[0], 1, 1, TESSERA)
    two = merge([one, simulate(cells[1], 1, 1, TESSERA)])
    assert two.requests == len(cells[0]) + len(cells[1])
    assert two.met + two.late + two.rejected + two.unfinished == two.requests
    assert two.mem_samples[0][1] >= one.mem_samples[0][1]
    stats, wall = scale_run(ScaleJob(5, 12, 60.0, 3.0, 2, 2, cells=2))
    assert stats.requests == len(trace) and wall > 0


def test_a_preempted_instances_requests_resume_elsewhere_with_their_text_so_far() -> None:
    # LLM-Mesh §7.1 as the simulator executes it: the instance stops, its decoding requests
    # go on from where they were (their tokens so far become part of the prompt), and every
    # request still ends met, late or rejected.
    sim = Sim(generate(5, 6, 60.0, 2.0), 2, 2, TESSERA)
    victim_seen: list[int] = []
    original = sim.on_prefill_done

    def preempt_once(node):  # once, half-way through, preempt an instance with decoding requests
        original(node)
        if not victim_seen and sim.now > 30.0:
            inst = next((i for i in node.insts.values() if i.nd and i.ready), None)
            if inst is not None:
                victim_seen.extend(r.rid for r in inst.reqs)
                sim.preempt(inst)

    sim.on_prefill_done = preempt_once  # type: ignore[method-assign]
    st = sim.run()
    assert victim_seen and st.preemptions >= 1
    moved = [sim.reqs[i] for i in victim_seen]
    assert all(r.outcome in {"met", "late", "rejected"} for r in moved)
    assert any(r.k0 > 0 and r.outcome != "rejected" for r in moved)
    assert st.met + st.late + st.rejected == st.requests

"""The batch's device sampler picks, row for row, the token the host's `Sampler` picks from the
same logits and the same seed (so a request's seed means the same on either path)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from services.engine.sampling import Sampler
from services.engine.torch_engine.row_sampling import ALL, COLUMNS, GREEDY, Branches, RowDraw, fill_table, pick_rows

SETTINGS = [
    # temperature, top_p, top_k, min_p
    (0.0, 1.0, 0, 0.0),
    (1.0, 1.0, 0, 0.0),
    (0.8, 0.95, 0, 0.0),
    (0.7, 0.5, 0, 0.0),
    (1.3, 1.0, 40, 0.0),
    (1.0, 0.9, 5, 0.0),
    (1.0, 1.0, 0, 0.05),
    (0.6, 0.8, 20, 0.02),
    (1.0, 1e-6, 0, 0.0),
]


def table_of(rows: list[RowDraw], device: torch.device | str = "cpu") -> torch.Tensor:
    table = torch.empty((COLUMNS, len(rows)), dtype=torch.float64)
    fill_table(table, rows)
    return table.to(device)


def logits(rows: int, vocab: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    out = (rng.standard_normal((rows, vocab)) * 3).astype(np.float32)
    out[:, :8] = out[:, 8:16]  # equal values: their order must be the host's
    return out


def pick(x: torch.Tensor, rows: list[RowDraw], static: bool = False) -> list[int]:
    """What a step picks: with the branches its rows need, or (static) every branch, as a
    step replayed from a CUDA graph runs."""
    branches = ALL if static else Branches.of(rows, x.size(1))
    out: list[int] = pick_rows(x, table_of(rows, x.device), branches).tolist()
    return out


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("seed", range(4))
def test_every_row_picks_what_the_host_sampler_picks_for_the_same_seed(seed: int, static: bool) -> None:
    steps, vocab = 12, 3000
    hosts = [Sampler(t, p, 100 * seed + i, top_k=k, min_p=m) for i, (t, p, k, m) in enumerate(SETTINGS)]
    devices = [Sampler(t, p, 100 * seed + i, top_k=k, min_p=m) for i, (t, p, k, m) in enumerate(SETTINGS)]
    for step in range(steps):
        x = logits(len(SETTINGS), vocab, 1000 * seed + step)
        expected = [s.pick(x[i]) for i, s in enumerate(hosts)]
        assert pick(torch.from_numpy(x), [RowDraw.of(s) for s in devices], static) == expected


def test_the_draws_are_each_requests_own_so_neighbours_change_nothing() -> None:
    x = logits(3, 500, 7)
    alone = pick(torch.from_numpy(x[1:2]), [RowDraw.of(Sampler(1.0, 0.9, 42))])
    crowd = [Sampler(1.0, 1.0, 1), Sampler(1.0, 0.9, 42), Sampler(0.5, 0.5, 3)]
    assert pick(torch.from_numpy(x), [RowDraw.of(s) for s in crowd])[1] == alone[0]


def test_greedy_rows_take_the_first_maximum_and_consume_no_draw() -> None:
    x = np.zeros((2, 10), dtype=np.float32)
    x[0, 3] = x[0, 7] = 5.0
    x[1, 9] = 1.0
    sampler = Sampler(0.0, 1.0, 5)
    before = sampler.rng.bit_generator.state
    assert pick(torch.from_numpy(x), [RowDraw.of(sampler), GREEDY]) == [3, 9]
    assert pick(torch.from_numpy(x), [GREEDY, GREEDY], static=True) == [3, 9]
    assert sampler.rng.bit_generator.state == before


def test_a_row_in_bfloat16_is_sampled_from_its_own_distribution() -> None:
    # Only the top two tokens carry mass; top_p 0.9 keeps both; the draws must land on both.
    x = torch.full((1, 50), -30.0, dtype=torch.bfloat16)
    x[0, 4], x[0, 11] = 2.0, 2.0
    s = Sampler(1.0, 0.9, 0)
    seen = {pick(x, [RowDraw.of(s)])[0] for _ in range(64)}
    assert seen == {4, 11}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device; this machine has none")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_on_a_gpu_every_row_picks_what_the_host_sampler_picks(dtype: torch.dtype) -> None:
    # The device's sort, scan and search must agree with numpy's, equal values included; the
    # host is given the same (rounded) logits the device sees.
    steps, vocab = 8, 49152
    hosts = [Sampler(t, p, 7 + i, top_k=k, min_p=m) for i, (t, p, k, m) in enumerate(SETTINGS)]
    devices = [Sampler(t, p, 7 + i, top_k=k, min_p=m) for i, (t, p, k, m) in enumerate(SETTINGS)]
    for step in range(steps):
        x = torch.from_numpy(logits(len(SETTINGS), vocab, step)).to(dtype)
        expected = [s.pick(x[i].float().numpy()) for i, s in enumerate(hosts)]
        draws = [RowDraw.of(s) for s in devices]
        got = pick_rows(x.cuda(), table_of(draws, "cuda"))
        assert got.device.type == "cuda"
        assert got.tolist() == expected


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device; this machine has none")
def test_a_step_captured_in_a_cuda_graph_picks_from_the_table_it_is_replayed_with() -> None:
    # What the batch relies on under graphs: the Python runs once, at capture; each replay
    # reads the logits and the table written since.
    vocab, rows = 4096, len(SETTINGS)
    static_logits = torch.zeros((rows, vocab), device="cuda")
    table = table_of([GREEDY] * rows, "cuda")
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        pick_rows(static_logits, table)  # warm-up, as the library runs one before capturing
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        out = pick_rows(static_logits, table)
    hosts = [Sampler(t, p, 3 + i, top_k=k, min_p=m) for i, (t, p, k, m) in enumerate(SETTINGS)]
    devices = [Sampler(t, p, 3 + i, top_k=k, min_p=m) for i, (t, p, k, m) in enumerate(SETTINGS)]
    for step in range(6):
        x = logits(rows, vocab, 50 + step)
        expected = [s.pick(x[i]) for i, s in enumerate(hosts)]
        static_logits.copy_(torch.from_numpy(x))
        table.copy_(table_of([RowDraw.of(s) for s in devices]))
        graph.replay()
        assert out.tolist() == expected


def test_a_row_below_the_sampling_epsilon_is_greedy_on_the_device_as_on_the_host() -> None:
    from services.engine.sampling import SAMPLING_EPS

    sampler = Sampler(SAMPLING_EPS / 2, 1.0, 7)
    row = RowDraw.of(sampler)
    assert row.uniform == 0.0  # a greedy row consumes no draw of its request's generator
    logits = torch.tensor([[0.0, 2.0, 1.9]])
    assert pick_rows(logits, table_of([row])).tolist() == [1] == [sampler.pick(logits[0].numpy())]

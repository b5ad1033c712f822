"""The pure parts of `bench/serverless.py`: the trace's skew and determinism, how a stream's
lines are judged against a 30 s client timeout with and without progress comments, and that
each model copy is a distinct artifact with the same tensors."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import gguf

from bench import serverless_trace
from bench.serverless_client import Lines, Timed, summarize
from bench.serverless_models import tagged, write_copy
from ops.localcluster import default_model_path
from services.loader.store import sha256_of


def test_the_trace_is_seeded_skewed_and_bursty() -> None:
    a = serverless_trace.generate(35, 20, 0.5, 600)
    assert a == serverless_trace.generate(35, 20, 0.5, 600)
    assert a != serverless_trace.generate(36, 20, 0.5, 600)
    assert all(x.at_s <= y.at_s for x, y in itertools.pairwise(a))
    counts = serverless_trace.popularity(a, 20)
    assert sum(counts[:3]) > sum(counts[10:])  # the head carries more than the tail's half
    # A shorter trace is the longer one cut: each model keeps its own pattern.
    short = serverless_trace.generate(35, 20, 0.5, 300)
    assert short == [x for x in a if x.at_s < 300]
    # Bursty: the most popular model's inter-arrival times vary more than a Poisson process's.
    times = [x.at_s for x in a if x.rank == 0]
    gaps = [t2 - t1 for t1, t2 in itertools.pairwise(times)]
    mean = sum(gaps) / len(gaps)
    cv = (sum((g - mean) ** 2 for g in gaps) / len(gaps)) ** 0.5 / mean
    assert cv > 1.2


def chunk(content: str, model: str = "m") -> str:
    return "data: " + json.dumps({"model": model, "choices": [{"delta": {"content": content}}]})


def fed(lines: list[tuple[float, str]]) -> Timed:
    rec = Timed(rank=0, requested="alias", at_s=0.0, sent=0.0, status="200")
    stream = Lines(rec)
    for t, line in lines:
        if not stream.feed(line, t):
            break
    rec.done = lines[-1][0]
    return rec


def test_progress_comments_reset_the_timeout_that_data_lines_alone_do_not() -> None:
    rec = fed(
        [
            (10.0, ": tessera loading phase=load 10% eta=25.0s"),
            (20.0, ": tessera loading phase=load 40% eta=15.0s"),
            (31.0, ": tessera loading phase=load 90% eta=?"),
            (40.0, chunk("Hi", model="small")),
            (40.5, ""),
            (41.0, chunk(" there", model="small")),
            (41.5, "data: [DONE]"),
        ]
    )
    assert rec.ttft_s == 40.0 and rec.served_by == "small"
    assert rec.max_data_gap_s == 40.0  # sent → first data line, the comments not counted
    assert rec.max_line_gap_s == 11.0  # 20 → 31: the longest silence with comments
    assert rec.comments == 3 and rec.progress_pct == [10, 40, 90]
    quick = fed([(1.0, chunk("Hi")), (45.0, chunk("late")), (46.0, "data: [DONE]")])
    out = summarize([rec, quick], trace_s=180.0, wall_s=200.0, cold_starts=3)
    assert out["timeouts_30s"] == 2  # a 44 s stall between two tokens loses the second too
    assert out["timeouts_30s_with_progress"] == 1
    assert out["cold_starts_per_hour"] == 60.0  # 3 over the trace's 180 s, not the wall's 200
    assert out["served_by"] == {"alias": {"small": 1, "m": 1}}


def test_a_copy_is_a_distinct_artifact_with_the_same_tensors(tmp_path: Path) -> None:
    assert tagged(b"SmolLM2 135M", "#07") == b"SmolLM2 1#07"
    base = default_model_path()
    copy = tmp_path / "copy.gguf"
    write_copy(base, copy, "#07")
    assert copy.stat().st_size == base.stat().st_size
    assert sha256_of(copy) != sha256_of(base)
    a, b = gguf.GGUFReader(str(base)), gguf.GGUFReader(str(copy))
    assert bytes(b.fields["general.name"].parts[-1]).endswith(b"#07")
    assert [t.name for t in a.tensors] == [t.name for t in b.tensors]
    assert all(bytes(x.data) == bytes(y.data) for x, y in zip(a.tensors[:3], b.tensors[:3], strict=True))

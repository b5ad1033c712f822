"""The perf book: engines' iteration reports, grouped on LLM-Mesh §5.2's power-of-two grid and
fitted into the perf models placement validates with."""

from __future__ import annotations

import pytest

from policy.perf_book import PerfBook
from shared.messages import PerfReport
from tests.helpers.records import RECORD


def test_perf_book_scales_batched_iterations_from_the_batch_of_one() -> None:
    book = PerfBook()
    # Alone: 10 ms at length 64. Batches of 4 (bucketed from 3 and 4) took 1.5× that; of 16, 1.2×
    # (noise): a wider batch is kept at least as slow as a narrower one.
    book.report(
        "n0",
        "cpu",
        PerfReport(
            "a1", prefill=((64, 0.1),), decode=((1, 64, 0.010), (3, 64, 0.015), (4, 64, 0.015), (16, 64, 0.012))
        ),
    )
    perf = book.model("a1")
    assert perf is not None
    assert perf.decode_s(1, 64) == pytest.approx(0.010)
    assert perf.decode_s(4, 64) == pytest.approx(0.015)
    assert perf.decode_s(16, 64) == pytest.approx(0.015)


def test_perf_book_fits_from_reports_grouping_lengths_by_power_of_two() -> None:
    book = PerfBook()
    assert book.model("a1") is None
    book.report("n0", "cpu", PerfReport("a1", prefill=((30, 0.06), (34, 0.07)), decode=((1, 60, 0.015),)))
    book.report("n1", "cpu", PerfReport("a1", prefill=((500, 1.0),), decode=((1, 70, 0.017),)))
    perf = book.model("a1")
    assert perf is not None
    assert perf.prefill_s(32) == pytest.approx(0.065)  # 30 and 34 both count as 32
    assert perf.decode_s(1, 64) == pytest.approx(0.016)
    (p,) = book.profiles([RECORD]).values()
    assert p.kv_bytes == 200 and p.weight_bytes == 5 and p.tpot_slo_s == 0.1


def test_perf_book_keeps_cells_a_later_window_does_not_cover() -> None:
    # Under a crowd a node's latest window holds only wide batches. The model must survive it
    # (else placement falls back to no validation and no admission), take the new batched
    # row, and keep the batch of one it measured before.
    book = PerfBook()
    book.report("n0", "cpu", PerfReport("a1", prefill=((64, 0.1),), decode=((1, 64, 0.010),)))
    book.report("n0", "cpu", PerfReport("a1", prefill=((64, 0.2),), decode=((128, 64, 0.500),)))
    perf = book.model("a1")
    assert perf is not None
    assert perf.decode_s(1, 64) == pytest.approx(0.010)
    assert perf.decode_s(128, 64) == pytest.approx(0.500)
    assert perf.prefill_s(64) == pytest.approx(0.2)  # a cell the new window covers is replaced
    assert set(book.profiles([RECORD])) == {RECORD.name}
    # A cell measured again is refitted from its new samples only.
    book.report("n0", "cpu", PerfReport("a1", prefill=(), decode=((1, 64, 0.020),)))
    perf = book.model("a1")
    assert perf is not None and perf.decode_s(1, 64) == pytest.approx(0.020)


def test_the_perf_book_profiles_every_kind_it_has_measured() -> None:
    book = PerfBook()
    for kind, scale in (("cpu", 1.0), ("gpu", 0.1)):
        book.report(
            "n-" + kind,
            kind,
            PerfReport(
                artifact_id="a1",
                prefill=((64, 0.1 * scale), (512, 0.8 * scale)),
                decode=((1, 64, 0.02 * scale), (1, 512, 0.03 * scale)),
            ),
        )
    (p,) = book.profiles([RECORD]).values()
    assert set(p.perf_by_kind) == {"cpu", "gpu"}
    assert p.perf_on("gpu").prefill_s(512) == pytest.approx(0.1 * p.perf_on("cpu").prefill_s(512), rel=1e-6)
    assert p.perf is p.perf_on("cpu")  # the default kind's, where a node's kind is unknown


def test_a_crowd_that_never_ran_a_request_alone_still_gives_a_model() -> None:
    # A continuous-batching engine under steady load reports rows of batches of 4 and 8 only:
    # the batch of 4 stands for one row alone (no faster than alone: the safe side), and the
    # batch of 8 is scaled from it.
    book = PerfBook()
    book.report("n0", "cpu", PerfReport("a1", prefill=((64, 0.1),), decode=((4, 64, 0.020), (8, 64, 0.030))))
    perf = book.model("a1")
    assert perf is not None
    assert perf.decode_s(1, 64) == pytest.approx(0.020)
    assert perf.decode_s(8, 64) == pytest.approx(0.030)
    assert set(book.profiles([RECORD])) == {RECORD.name}

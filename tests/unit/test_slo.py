"""A request's TTFT SLO grows with its prompt (LLM-Mesh §8.1: max(2, L / 512) s), and the
scheduler's policy judges lateness by it."""

from __future__ import annotations

import msgspec
import pytest

from policy.perf_book import PerfBook
from policy.perf_model import DecodeSample, PerfModel, PrefillSample
from policy.placement import Demand, Profile
from policy.scheduling import NodeView, StartOn, UseNode, place
from policy.slo import ttft_slo
from shared.messages import Artifact, ErrorCode, InstanceView, ModelRecord, PerfReport, Rejected

NOW = 1000.0


def record(ttft_slo_s: float = 2.0, ttft_slo_per_token_s: float | None = None) -> ModelRecord:
    """A registration; `ttft_slo_per_token_s` None: its default (the paper's 1/512 s)."""
    r = ModelRecord(
        name="m",
        source="/m.gguf",
        artifact=Artifact(
            artifact_id="a1", path="/a", source_sha256="s", context_length=8192, kv_bytes_per_token=2, weight_bytes=5
        ),
        ttft_slo_s=ttft_slo_s,
        tpot_slo_s=0.1,
        keep_alive_s=60,
        created_at=0,
    )
    if ttft_slo_per_token_s is None:
        return r
    return msgspec.structs.replace(r, ttft_slo_per_token_s=ttft_slo_per_token_s)


def test_the_papers_numbers_2_s_for_a_short_prompt_8_s_at_4096_tokens() -> None:
    paper = record()  # the registration's defaults are the paper's
    assert ttft_slo(paper, 0) == 2.0
    assert ttft_slo(paper, 100) == 2.0
    assert ttft_slo(paper, 1024) == 2.0  # where the two terms meet
    assert ttft_slo(paper, 2048) == 4.0
    assert ttft_slo(paper, 4096) == 8.0


def test_the_larger_of_the_floor_and_the_allowance_not_their_sum() -> None:
    assert ttft_slo(record(ttft_slo_s=5.0), 2048) == 5.0
    assert ttft_slo(record(ttft_slo_s=5.0), 4096) == 8.0
    assert ttft_slo(record(ttft_slo_per_token_s=0.01), 1000) == 10.0


def test_no_allowance_keeps_the_ttft_slo_fixed() -> None:
    assert ttft_slo(record(ttft_slo_s=1.5, ttft_slo_per_token_s=0.0), 100_000) == 1.5


def test_a_record_stored_before_the_allowance_existed_reads_as_the_papers() -> None:
    old = msgspec.structs.asdict(record())
    del old["ttft_slo_per_token_s"]
    encoded = msgspec.msgpack.encode({"type": "ModelRecord", **old})
    assert ttft_slo(msgspec.msgpack.decode(encoded, type=ModelRecord), 4096) == 8.0


def test_the_perf_book_carries_the_allowance_into_the_profile() -> None:
    book = PerfBook()
    book.report("n0", "cpu", PerfReport("a1", prefill=((32, 0.06), (512, 1.0)), decode=((1, 64, 0.015),)))
    (fixed,) = book.profiles([record(ttft_slo_per_token_s=0.0)]).values()
    (grown,) = book.profiles([record()]).values()
    assert ttft_slo(fixed, 4096) == 2.0 and ttft_slo(grown, 4096) == 8.0


# 1 ms per prompt token, 20 ms per decode iteration: a 4,096-token prompt prefills in 4.1 s.
PERF = PerfModel.fit(
    [PrefillSample(1, 0.001), PrefillSample(1000, 1.0)], [DecodeSample(1, 1, 0.02), DecodeSample(1, 1000, 0.02)]
)
PROFILES = {"m": Profile(PERF, 2.0, 0.1, "a1", weight_bytes=100, kv_bytes=10, start_s=0.5)}


def busy_and_spare() -> list[NodeView]:
    """Node a runs m with one request decoding (50 tokens to go: 1 s); node b could start m in 0.5 s."""
    busy = InstanceView(model="m", active=1, running=1, held_tokens=10, last_used=NOW, loaded_at=NOW - 10)
    return [NodeView("a", NOW, {"m": busy}), NodeView("b", NOW)]


def decide(prompt: int, ttft: float, reject_over_slo: float | None = None) -> object:
    return place(
        "m",
        busy_and_spare(),
        {},
        NOW,
        node_timeout_s=3,
        max_active_per_instance=16,
        demand=Demand(prompt, 50, ttft, 0.1),
        profiles=PROFILES,
        reject_over_slo=reject_over_slo,
    )


def test_a_long_prompt_is_no_longer_late_so_it_joins_instead_of_scaling_out() -> None:
    # 4,096 tokens on "a": 1.1 × (1.0 s behind the running request + 4.1 s prefill) = 5.6 s;
    # a start on "b": 1.1 × (0.5 + 4.1) = 5.1 s. Against a fixed 2 s both are late and the
    # soonest, the new instance, wins: a scale-out for a prompt that is merely long. Against
    # its grown SLO (8 s) it joins "a".
    long = 4096
    assert isinstance(decide(long, record().ttft_slo_s), StartOn)
    assert decide(long, ttft_slo(record(), long)) == UseNode("a")
    # A short prompt is judged as before: 1.1 × (1.0 + 0.1) = 1.2 s, within 2 s.
    assert decide(100, ttft_slo(record(), 100)) == UseNode("a")


def test_the_early_reject_weighs_a_long_prompt_against_its_own_slo() -> None:
    # Past 1 × a fixed 2 s SLO wherever it goes: refused at once; within 8 s: served.
    refused = decide(4096, record().ttft_slo_s, reject_over_slo=1.0)
    assert isinstance(refused, Rejected) and refused.code is ErrorCode.OVERLOADED
    assert isinstance(decide(4096, ttft_slo(record(), 4096), reject_over_slo=1.0), UseNode)


@pytest.mark.parametrize("prompt", [1, 512, 1024, 1025, 3000, 8192])
def test_the_ttft_slo_never_shrinks_as_the_prompt_grows(prompt: int) -> None:
    assert ttft_slo(record(), prompt) <= ttft_slo(record(), prompt + 1)

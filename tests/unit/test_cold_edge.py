"""The cold-start budget as a request gives it (header or body) and the header that tells it
what a start cost it."""

from __future__ import annotations

import pytest

from services.gateway.cold import COLD_START_HEADER, MAX_WAIT_HEADER, cold_start_header, max_wait_s
from shared.errors import TesseraError
from shared.routing_messages import Placement


def test_the_budget_comes_from_the_header_or_the_body() -> None:
    assert max_wait_s(None, None) is None
    assert max_wait_s("2", None) == 2.0
    assert max_wait_s(" 0.5 ", None) == 0.5
    assert max_wait_s(None, 1.5) == 1.5
    assert max_wait_s("1.5", 1.5) == 1.5


@pytest.mark.parametrize("bad", ["-1", "abc", "nan", "inf", "1e3", "1_0", ""])
def test_a_header_that_is_not_seconds_is_a_400_naming_it(bad: str) -> None:
    with pytest.raises(TesseraError) as e:
        max_wait_s(bad, None)
    assert e.value.status == 400 and e.value.param == MAX_WAIT_HEADER


def test_header_and_body_that_disagree_are_a_400() -> None:
    with pytest.raises(TesseraError) as e:
        max_wait_s("2", 3.0)
    assert e.value.status == 400 and e.value.param == "tessera.max_wait_s"


def test_the_cold_start_header_is_set_only_for_a_request_that_waited_for_a_start() -> None:
    warm = Placement(request_id="r", node_id="n", cold_start=False)
    cold = Placement(request_id="r", node_id="n", cold_start=True, start_source="host", start_s=1.421)
    assert cold_start_header([warm, None], [0.0, 0.0]) == {}
    assert cold_start_header([warm, cold], [0.0, 1.3]) == {COLD_START_HEADER: "source=host; seconds=1.42; waited=1.30"}

"""A request's control over cold starts at the edge (issue 35): its cold-start budget, from the
`X-Tessera-Max-Wait` header or the body's `tessera.max_wait_s`, and the response header that
tells it what a start cost it (`x-tessera-cold-start`)."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

from shared.errors import TesseraError
from shared.messages import ErrorCode
from shared.routing_messages import Placement

MAX_WAIT_HEADER = "X-Tessera-Max-Wait"
COLD_START_HEADER = "x-tessera-cold-start"
_SECONDS = re.compile(r"[0-9]+(\.[0-9]*)?|\.[0-9]+")
"""Seconds as the header takes them: a plain decimal, 0 or more (no sign, exponent or `_`)."""


def max_wait_s(header: str | None, body_s: float | None) -> float | None:
    """The request's cold-start budget in seconds (None: none), from the header or the body;
    a 400 naming the parameter for a value that is not a number of seconds, or for both forms
    given with different values."""
    from_header = None
    if header is not None:
        text = header.strip()
        if not _SECONDS.fullmatch(text) or not math.isfinite(float(text)):
            raise TesseraError(
                ErrorCode.INVALID_REQUEST,
                f"the {MAX_WAIT_HEADER} header must be a number of seconds, 0 or more, not {text[:40]!r}",
                param=MAX_WAIT_HEADER,
            )
        from_header = float(text)
    if from_header is not None and body_s is not None and from_header != body_s:
        raise TesseraError(
            ErrorCode.INVALID_REQUEST,
            f"the {MAX_WAIT_HEADER} header ({from_header:g} s) and tessera.max_wait_s ({body_s:g} s) "
            "disagree: give one, or both the same",
            param="tessera.max_wait_s",
        )
    return from_header if from_header is not None else body_s


def cold_start_header(placements: Sequence[Placement | None], waited_s: Sequence[float]) -> dict[str, str]:
    """`x-tessera-cold-start` for a request whose generations waited for (or triggered) a start:
    the first such start's source and seconds, and how long this request waited for it; no
    header where every generation found its model warm."""
    for placed, waited in zip(placements, waited_s, strict=True):
        if placed is not None and placed.cold_start:
            source = placed.start_source or "unknown"
            value = f"source={source}; seconds={placed.start_s:.2f}; waited={waited:.2f}"
            return {COLD_START_HEADER: value}
    return {}

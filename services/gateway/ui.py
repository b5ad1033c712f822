"""The status page: `/ui` (one self-contained HTML file) and the one JSON call it polls.

The page holds no logic an operator could not get from the admin API: `/ui/api/summary` is the
admin API's models, instances and recent cold starts in one answer, plus the gateway's own
latency histograms (which otherwise live only on /metrics, in Prometheus text). The page is
open, since it holds no data; the summary needs the admin key like /admin does, which the page
asks for and keeps in the tab's sessionStorage.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from importlib.resources import files
from typing import Any

from fastapi import APIRouter, Depends
from fastapi.responses import HTMLResponse
from prometheus_client import Histogram

from services.gateway.admin import Admin
from services.gateway.generation import TPOT, TTFT
from shared.errors import TesseraError

COLD_STARTS_SHOWN = 40
"""Bars the cold-start chart draws; the registry keeps more (GET /admin/coldstarts)."""


def histogram_snapshot(histogram: Histogram) -> list[dict[str, Any]]:
    """Each labelled series of a histogram as cumulative buckets, count and sum.

    Cumulative, as Prometheus keeps them: the page subtracts two polls to get the requests of
    the last interval, so that every viewer sees its own window and the gateway keeps no
    per-viewer state. `le` stays a string because JSON has no infinity ("+Inf")."""
    series: dict[tuple[tuple[str, str], ...], dict[str, Any]] = {}
    for family in histogram.collect():
        for sample in family.samples:
            labels = {k: v for k, v in sample.labels.items() if k != "le"}
            entry = series.setdefault(
                tuple(sorted(labels.items())), {"labels": labels, "buckets": [], "count": 0.0, "sum": 0.0}
            )
            if sample.name.endswith("_bucket"):
                entry["buckets"].append([sample.labels["le"], sample.value])
            elif sample.name.endswith("_count"):
                entry["count"] = sample.value
            elif sample.name.endswith("_sum"):
                entry["sum"] = sample.value
    return list(series.values())


def ui_router(admin: Admin, admin_guard: Callable[..., Awaitable[object]]) -> APIRouter:
    """`admin_guard` is the dependency that guards /admin (routes.py owns auth)."""
    router = APIRouter()
    page = files("services.gateway").joinpath("static/status.html").read_text(encoding="utf-8")

    @router.get("/ui", include_in_schema=False)
    async def status_page() -> HTMLResponse:
        return HTMLResponse(page, headers={"Cache-Control": "no-cache"})

    @router.get("/ui/api/summary", dependencies=[Depends(admin_guard)])
    async def summary() -> dict[str, Any]:
        # Instances come from the scheduler over the bus; while it is down the page should
        # still show models, cold starts and latency, and say why instances are missing.
        instances: dict[str, Any] | None = None
        instances_error = ""
        try:
            instances = await admin.instances()
        except TesseraError as e:
            instances_error = e.message
        caches: list[dict[str, Any]] = []
        if instances is not None:
            try:
                caches = await admin.cache()
            except TesseraError:
                caches = []
        return {
            "models": await admin.list(),
            "instances": instances,
            "caches": caches,
            "instances_error": instances_error,
            "cold_starts": await admin.cold_starts(COLD_STARTS_SHOWN),
            "latency": {"ttft": histogram_snapshot(TTFT), "tpot": histogram_snapshot(TPOT)},
        }

    return router

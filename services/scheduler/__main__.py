"""`python -m services.scheduler`: placement, cold starts and keep-alive for the cluster."""

from __future__ import annotations

import asyncio

from services.scheduler.service import SchedulerService
from services.scheduler.settings import SchedulerSettings
from shared.logs import setup_logging
from shared.registry import Registry
from shared.runtime import run_service


async def main() -> None:
    settings = SchedulerSettings()
    setup_logging("scheduler", settings.log_level)
    await run_service("scheduler", settings, lambda rt: SchedulerService(settings, rt.bus, Registry(rt.valkey)))


if __name__ == "__main__":
    asyncio.run(main())

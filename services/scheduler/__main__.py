"""`python -m services.scheduler`: placement, cold starts and keep-alive for the cluster."""

from __future__ import annotations

import asyncio

from services.scheduler.service import SchedulerService
from services.scheduler.settings import SchedulerSettings
from shared.health import health_app
from shared.logs import setup_logging
from shared.registry import Registry
from shared.runtime import ServiceRuntime


async def main() -> None:
    settings = SchedulerSettings()
    setup_logging("scheduler", settings.log_level)
    async with ServiceRuntime("scheduler", settings) as rt:
        scheduler = SchedulerService(settings, rt.bus, Registry(rt.valkey))
        await scheduler.start()
        try:
            await rt.serve(health_app(rt.readiness))
        finally:
            await scheduler.close()


if __name__ == "__main__":
    asyncio.run(main())

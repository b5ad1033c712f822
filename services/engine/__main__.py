"""`python -m services.engine`: model instances of this node (OpenVINO on CPU)."""

from __future__ import annotations

import asyncio
import os

from services.engine.service import EngineService
from services.engine.settings import EngineSettings, parse_cores
from shared.cpu_quota import cpu_quota
from shared.logs import setup_logging
from shared.runtime import run_service


async def main() -> None:
    settings = EngineSettings()
    setup_logging("engine", settings.log_level)
    if settings.cpu_cores:
        # Workers are spawned from this process and inherit its cores.
        os.sched_setaffinity(0, parse_cores(settings.cpu_cores))
    with cpu_quota(settings.cpu_quota, settings.node_id):
        await run_service("engine", settings, lambda rt: EngineService(settings, rt.bus))


if __name__ == "__main__":
    asyncio.run(main())

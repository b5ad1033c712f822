"""`python -m services.memory_manager`: this node's memory budget."""

from __future__ import annotations

import asyncio

from services.memory_manager.service import MemoryManagerService
from services.memory_manager.settings import MemoryManagerSettings
from shared.health import health_app
from shared.logs import setup_logging
from shared.runtime import ServiceRuntime


async def main() -> None:
    settings = MemoryManagerSettings()
    setup_logging("memory_manager", settings.log_level)
    async with ServiceRuntime("memory_manager", settings) as rt:
        await MemoryManagerService(settings, rt.bus).start()
        await rt.serve(health_app(rt.readiness))


if __name__ == "__main__":
    asyncio.run(main())

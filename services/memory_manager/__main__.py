"""`python -m services.memory_manager`: this node's memory budget."""

from __future__ import annotations

import asyncio

from services.memory_manager.service import MemoryManagerService
from services.memory_manager.settings import MemoryManagerSettings
from shared.logs import setup_logging
from shared.runtime import run_service


async def main() -> None:
    settings = MemoryManagerSettings()
    setup_logging("memory_manager", settings.log_level)
    await run_service("memory_manager", settings, lambda rt: MemoryManagerService(settings, rt.bus))


if __name__ == "__main__":
    asyncio.run(main())

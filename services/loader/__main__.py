"""`python -m services.loader`: model store import for this node."""

from __future__ import annotations

import asyncio

from services.loader.service import LoaderService
from services.loader.settings import LoaderSettings
from shared.logs import setup_logging
from shared.runtime import run_service


async def main() -> None:
    settings = LoaderSettings()
    setup_logging("loader", settings.log_level)
    await run_service("loader", settings, lambda rt: LoaderService(settings, rt.bus))


if __name__ == "__main__":
    asyncio.run(main())

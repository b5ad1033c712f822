"""`python -m services.loader`: model store import for this node."""

from __future__ import annotations

import asyncio

from services.loader.service import LoaderService
from services.loader.settings import LoaderSettings
from shared.health import health_app
from shared.logs import setup_logging
from shared.runtime import ServiceRuntime


async def main() -> None:
    settings = LoaderSettings()
    setup_logging("loader", settings.log_level)
    async with ServiceRuntime("loader", settings) as rt:
        await LoaderService(settings, rt.bus).start()
        await rt.serve(health_app(rt.readiness))


if __name__ == "__main__":
    asyncio.run(main())

"""`python -m services.engine`: model instances of this node (OpenVINO on CPU)."""

from __future__ import annotations

import asyncio

from services.engine.service import EngineService
from services.engine.settings import EngineSettings
from shared.health import health_app
from shared.logs import setup_logging
from shared.runtime import ServiceRuntime


async def main() -> None:
    settings = EngineSettings()
    setup_logging("engine", settings.log_level)
    async with ServiceRuntime("engine", settings) as rt:
        engine = EngineService(settings, rt.bus)
        await engine.start()
        try:
            await rt.serve(health_app(rt.readiness))
        finally:
            await engine.close()


if __name__ == "__main__":
    asyncio.run(main())

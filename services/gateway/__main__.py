"""`python -m services.gateway`: the OpenAI-compatible API, the admin API, health."""

from __future__ import annotations

import asyncio

from services.gateway.admin import Admin
from services.gateway.connection import guarded_protocol
from services.gateway.routes import create_app
from services.gateway.serving import Gateway
from services.gateway.settings import GatewaySettings
from shared.logs import setup_logging
from shared.registry import Registry
from shared.runtime import ServiceRuntime


async def main() -> None:
    settings = GatewaySettings()
    setup_logging("gateway", settings.log_level)
    async with ServiceRuntime("gateway", settings) as rt:
        registry = Registry(rt.valkey)
        gateway = Gateway(settings, rt.bus, registry)
        await gateway.start()
        app = create_app(gateway, Admin(settings, rt.bus, registry, gateway.tokenizers), rt.readiness)
        await rt.serve(app, http=guarded_protocol(settings.request_head_timeout_s))


if __name__ == "__main__":
    asyncio.run(main())

"""The conductor process: serves the `conductor:` section of the mesh file (started by `tandem conductor`)."""

from __future__ import annotations

import gc

from conductor.app import SERVICE_NAME, Conductor
from conductor.config import ConductorConfig
from conductor.metrics import register
from tandem.grpc_server import GrpcApp


async def serve(config: ConductorConfig) -> None:
    """Serves until SIGTERM."""
    conductor = Conductor(config)
    app = GrpcApp("conductor", listen=config.listen, metrics_listen=config.metrics_listen)
    app.add_service(SERVICE_NAME, lambda servicer, server: conductor.add_to(server), conductor.service)
    register(conductor.core, conductor.extra_counters)
    app.on_stop(conductor.stop)

    async def after_start() -> None:
        await conductor.start()
        # Everything alive now (modules, grpc, pydantic) is moved out of the collector's reach: a full collection
        # then costs what the index allocated since, not ~10 ms of imports, which would show in Match's p99.
        gc.freeze()

    await app.run(after_start=after_start)

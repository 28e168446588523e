"""The conductor process: serves the `conductor:` section of the mesh file (started by `tandem conductor`)."""

from __future__ import annotations

import gc

from conductor.app import SERVICE_NAME, Conductor
from conductor.config import ConductorConfig
from conductor.metrics import register
from tandem.grpc_server import GrpcApp
from tandem.tls import TlsFiles

#: Who may call what on the conductor (`tandem.authz`; checked when the mesh runs with TLS).
RULES = {
    f"/{SERVICE_NAME}/Ingest": ("agent/*",),
    f"/{SERVICE_NAME}/Match": ("coordinator", "operator"),  # operators: to see what the index holds
    f"/{SERVICE_NAME}/GetIndexStats": ("operator", "coordinator"),
}


async def serve(config: ConductorConfig, tls: TlsFiles | None = None) -> None:
    """Serves until SIGTERM (mutual TLS and authorization with `tls`)."""
    conductor = Conductor(config)
    app = GrpcApp(
        "conductor", listen=config.listen, metrics_listen=config.metrics_listen, tls=tls, rules=RULES
    )
    app.add_service(SERVICE_NAME, lambda servicer, server: conductor.add_to(server), conductor.service)
    register(conductor.core, conductor.extra_counters)
    app.on_stop(conductor.stop)

    async def after_start() -> None:
        await conductor.start()
        # Everything alive now (modules, grpc, pydantic) is moved out of the collector's reach: a full collection
        # then costs what the index allocated since, not ~10 ms of imports, which would show in Match's p99.
        gc.freeze()

    await app.run(after_start=after_start)

"""The coordinator's health service speaks for the whole mesh behind Envoy's gRPC listener.

Envoy routes `grpc.health.v1.Health` on :9000 to the coordinator, so the coordinator reports each `tandem.v1`
service: its own directly, the conductor's as seen through a health watch on the conductor, and the node agents'
as SERVING while at least one agent keeps its heartbeat stream open.
"""

from __future__ import annotations

import asyncio
import logging

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from coordinator.services import RegistryService
from tandem.tls import TlsFiles, aio_channel

log = logging.getLogger(__name__)

CONDUCTOR_SERVICE = "tandem.v1.Conductor"
NODE_AGENT_SERVICE = "tandem.v1.NodeAgent"
_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


async def watch_conductor(
    health, conductor_address: str, retry_s: float = 1.0, tls: TlsFiles | None = None
) -> None:
    """Mirrors the conductor's health into ours until cancelled."""
    while True:
        try:
            async with aio_channel(conductor_address, tls, "conductor") as channel:
                stub = health_pb2_grpc.HealthStub(channel)
                async for reply in stub.Watch(health_pb2.HealthCheckRequest(service="")):
                    await health.set(CONDUCTOR_SERVICE, reply.status)
        except grpc.aio.AioRpcError:
            pass
        await health.set(CONDUCTOR_SERVICE, _NOT_SERVING)
        await asyncio.sleep(retry_s)


async def watch_agents(health, registry: RegistryService, interval_s: float = 1.0) -> None:
    """SERVING for `tandem.v1.NodeAgent` while any agent streams heartbeats."""
    while True:
        await health.set(NODE_AGENT_SERVICE, _SERVING if registry.open_streams > 0 else _NOT_SERVING)
        await asyncio.sleep(interval_s)

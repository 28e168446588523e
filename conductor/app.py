"""Wires the conductor process (started by `tandem conductor` for the mesh file's `conductor:` section): index
core, gRPC service, direct ZMQ sources and the housekeeping tick, served until SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
from collections.abc import Mapping

import zmq.asyncio

from conductor.config import ConductorConfig
from conductor.direct import DirectSource
from conductor.event_owners import EventOwners
from conductor.freshness import SequenceTracker
from conductor.index import KvIndex
from conductor.ingest import IngestCore
from conductor.metrics import register
from conductor.service import ConductorService
from tandem.grpc_server import GrpcApp
from tandem.tls import TlsFiles
from tandem.v1 import conductor_pb2_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = "tandem.v1.Conductor"

#: Who may call what on the conductor (`tandem.authz`; checked when the mesh runs with TLS).
RULES = {
    f"/{SERVICE_NAME}/Ingest": ("agent/*",),
    f"/{SERVICE_NAME}/Match": ("coordinator", "operator"),  # operators: to see what the index holds
    f"/{SERVICE_NAME}/GetIndexStats": ("operator", "coordinator"),
}


class Conductor:
    """Everything the conductor runs, startable inside any asyncio loop (the process, or a test)."""

    def __init__(self, config: ConductorConfig, owners: Mapping[str, frozenset[str]] | None = None) -> None:
        """`owners`: instance id -> the nodes the mesh file lists it under (`conductor.event_owners`)."""
        self.config = config
        self.index = KvIndex(config.max_entries, config.eviction, config.max_blocks_per_holder)
        self.core = IngestCore(
            self.index, SequenceTracker(config.max_pending_batches, config.replay_timeout_s)
        )
        event_owners = EventOwners(
            owners, (ep.instance_id for ep in config.direct_endpoints), config.max_ranks_per_node
        )
        self.service = ConductorService(self.core, config, event_owners)
        self.ctx: zmq.asyncio.Context | None = None
        self.direct: list[DirectSource] = []
        self._tick: asyncio.Task | None = None

    def add_to(self, server) -> None:
        """Adds the `Conductor` service to a `grpc.aio` server."""
        conductor_pb2_grpc.add_ConductorServicer_to_server(self.service, server)

    def extra_counters(self) -> dict[str, int]:
        return {
            "rejected_batches": self.service.rejected_batches,
            "foreign_messages": self.service.foreign_messages,
            "holder_cap_evicted_entries": self.index.counters.holder_cap_evicted,
            "matches": self.service.matches,
            "truncated_matches": self.service.truncated_matches,
            "expired_matches": self.service.expired_matches,
            "dropped_replay_requests": self.service.dropped_replays,
            "direct_dropped_batches": sum(d.dropped for d in self.direct),
            "decode_errors": sum(d.decode_errors for d in self.direct),
        }

    async def start(self) -> None:
        """Starts the direct sources and the tick (replay deadlines)."""
        if self.config.direct_endpoints:
            self.ctx = zmq.asyncio.Context()
            for ep in self.config.direct_endpoints:
                src = DirectSource(
                    self.core, ep, self.ctx, self.config.direct_queue_size, self.config.replay_timeout_s
                )
                src.start()
                self.direct.append(src)
                log.info(
                    "direct subscription", extra={"instance_id": ep.instance_id, "endpoint": ep.endpoint}
                )
        self._tick = asyncio.create_task(self._ticker())

    async def _ticker(self) -> None:
        while True:
            await asyncio.sleep(0.5)
            try:
                self.core.tick()
            except Exception:  # keep ticking: a bug here must not stop replay deadlines
                log.exception("tick failed")

    async def stop(self) -> None:
        if self._tick is not None:
            self._tick.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._tick
        for src in self.direct:
            await src.stop()
        self.direct = []
        if self.ctx is not None:
            self.ctx.destroy(linger=0)
            self.ctx = None


async def run(
    config: ConductorConfig, tls: TlsFiles | None = None, owners: Mapping[str, frozenset[str]] | None = None
) -> None:
    """Serves until SIGTERM (mutual TLS and authorization with `tls`; KV events only from the owners' agents)."""
    conductor = Conductor(config, owners)
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

"""Wires the node agent process: supervisors, coordinator link, KV event relay, NodeAgent service."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os

from node_agent.config import NodeAgentConfig
from node_agent.coordinator_link import CoordinatorLink
from node_agent.kv_relay import KvEventRelay
from node_agent.launch import build_launch
from node_agent.service import NodeAgentService
from node_agent.supervisor import EngineState, EngineSupervisor
from tandem.config import MeshConfig
from tandem.grpc_server import GrpcApp
from tandem.v1 import node_agent_pb2_grpc

log = logging.getLogger(__name__)


class NodeAgent:
    """The engines of one node and the links that report them."""

    def __init__(self, config: NodeAgentConfig, coordinator_address: str, conductor_address: str) -> None:
        self.config = config
        self.runtime_dir = config.runtime_dir or f"/tmp/tandem-{config.node_id}"
        self.supervisors: dict[str, EngineSupervisor] = {}
        self.link = CoordinatorLink(coordinator_address, config.node_id, lambda: list(self.supervisors.values()))
        self.relay = KvEventRelay(conductor_address, config.node_id)
        for engine in config.engines:
            spec = build_launch(engine, self.runtime_dir)
            self.supervisors[engine.instance_id] = EngineSupervisor(
                engine,
                spec,
                config.restart,
                os.path.join(self.runtime_dir, f"{engine.instance_id}.log"),
                config.probe_interval_s,
                config.stop_grace_s,
                self._changed,
            )
        self._relayed: set[str] = set()
        self._tasks: list[asyncio.Task] = []

    async def _changed(self, sup: EngineSupervisor) -> None:
        iid = sup.engine.instance_id
        log.info("engine state", extra={"instance": iid, "state": sup.state.name, "detail": sup.detail})
        events = sup.spec.kv_events
        if sup.state is EngineState.RUNNING and events is not None and iid not in self._relayed:
            self._relayed.add(iid)
            self.relay.add_source(iid, sup.engine.model, sup.engine.block_size, 0, events.endpoint, events.replay_endpoint)
        elif sup.state is not EngineState.RUNNING and iid in self._relayed:
            self._relayed.discard(iid)
            self.relay.remove_source(iid)
        await self.link.changed(sup)

    async def start(self) -> None:
        """Launches every engine and the links."""
        os.makedirs(self.runtime_dir, exist_ok=True)
        self._tasks.append(asyncio.create_task(self.link.run()))
        self._tasks.append(asyncio.create_task(self.relay.run()))
        for sup in self.supervisors.values():
            log.info("launching engine", extra={"instance": sup.engine.instance_id, "argv": sup.spec.argv})
            sup.start()

    async def stop(self) -> None:
        """Deregisters and stops every engine, then the links."""
        for iid in list(self.link.registered):
            await self.link.deregister(iid, "agent shutdown")
        await asyncio.gather(*(sup.stop() for sup in self.supervisors.values()))
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        await self.relay.close()
        await self.link.close()


async def run(mesh: MeshConfig, node_id: str | None) -> None:
    """Serves one node until SIGTERM."""
    config = mesh.node_agent(node_id)
    agent = NodeAgent(
        config,
        config.coordinator_address or mesh.coordinator.listen,
        config.conductor_address or mesh.conductor.listen,
    )
    app = GrpcApp(f"node-agent {config.node_id}", config.listen, config.metrics_listen, grace=2.0)
    app.add_service(
        "tandem.v1.NodeAgent",
        node_agent_pb2_grpc.add_NodeAgentServicer_to_server,
        NodeAgentService(config.node_id, agent.supervisors),
    )
    app.on_stop(agent.stop)
    await app.run(agent.start)

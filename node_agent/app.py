"""Wires the node agent process: local services (engines, KV store), coordinator link, KV event relay, the
NodeAgent service, and systemd notifications."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import signal

from prometheus_client import REGISTRY

from node_agent.config import NodeAgentConfig
from node_agent.coordinator_link import CoordinatorLink
from node_agent.grpc_service import NodeAgentService
from node_agent.kv_relay import KvEventRelay
from node_agent.launch import LaunchError, Placement
from node_agent.local_services import ServiceError, build_services
from node_agent.metrics import AgentCollector
from node_agent.supervisor import EngineState, EngineSupervisor
from node_agent.systemd import SystemdNotify
from tandem.config_file import ConfigError
from tandem.grpc_server import GrpcApp
from tandem.tls import TlsFiles
from tandem.tracing import OTLP_TRACES_ENDPOINT
from tandem.v1 import node_agent_pb2_grpc

log = logging.getLogger(__name__)

#: Who may call what on a node agent (`tandem.authz`; checked when the mesh runs with TLS): the operator, directly or
#: through Envoy's control listener; the LoRA adapter methods only the coordinator (it decides where adapters go).
RULES = {
    "/tandem.v1.NodeAgent/": ("operator",),
    "/tandem.v1.NodeAgent/LoadAdapter": ("coordinator",),
    "/tandem.v1.NodeAgent/UnloadAdapter": ("coordinator",),
}


def with_otlp_traces(spec):
    """vLLM (and simengine, which mirrors it) exports its spans only when told `--otlp-traces-endpoint`: the
    collector the mesh's `tracing` put in the engine's environment (`tandem.tracing_config.engine_env`)."""
    endpoint = spec.env.get(OTLP_TRACES_ENDPOINT)
    if not endpoint or "--otlp-traces-endpoint" in spec.argv:
        return spec
    return dataclasses.replace(spec, argv=[*spec.argv, "--otlp-traces-endpoint", endpoint])


class NodeAgent:
    """The services of one node and the links that report them."""

    def __init__(
        self,
        config: NodeAgentConfig,
        coordinator_address: str,
        conductor_address: str | list[str],
        placement: Placement | None = None,
        tls: TlsFiles | None = None,
        engine_env: dict[str, str] | None = None,
    ) -> None:
        self.config = config
        self.runtime_dir = config.runtime_path
        # False (the default): on exit the agent leaves its engines running for the next agent to adopt.
        self.stop_engines_on_exit = False
        self.supervisors: dict[str, EngineSupervisor] = {}
        self.link = CoordinatorLink(coordinator_address, config.node_id, self._engine_supervisors, tls)
        # One relay per conductor replica: every replica indexes every engine, so any of them can answer a Match.
        addresses = [conductor_address] if isinstance(conductor_address, str) else list(conductor_address)
        self.relays = [KvEventRelay(address, config.node_id, tls=tls) for address in addresses]
        self.relay = self.relays[0]
        for relay in self.relays:
            relay.on_activity = self._engine_active
        self.services = build_services(config, self.runtime_dir, placement or Placement(), self._changed)
        for service in self.services:
            for sup in service.supervisors:
                self.supervisors[sup.name] = sup
                sup.on_load = self._load_reported
                if engine_env and sup.engine is not None:  # e.g. the CA bundle for callbacks over HTTPS
                    sup.spec = dataclasses.replace(sup.spec, env={**engine_env, **sup.spec.env})
                    sup.spec = with_otlp_traces(sup.spec)
        self._relayed: set[str] = set()
        self._tasks: list[asyncio.Task] = []

    def _load_reported(self, sup: EngineSupervisor) -> None:
        """After each scrape: the load to the coordinator, the KV capacity to the relays (the conductor's bound)."""
        self.link.load_reported(sup)
        if sup.load.kv_blocks:
            for relay in self.relays:
                relay.capacity[sup.spec.events_instance or sup.name] = sup.load.kv_blocks

    def _engine_active(self, instance_id: str) -> None:
        """A relayed engine published KV events (headless ranks' events name their API server, which is read)."""
        sup = self.supervisors.get(instance_id)
        if sup is not None:
            sup.activity()

    def _engine_supervisors(self) -> list[EngineSupervisor]:
        return [s for s in self.supervisors.values() if s.registrable]

    async def _changed(self, sup: EngineSupervisor) -> None:
        name = sup.name
        log.info("process state", extra={"instance": name, "state": sup.state.name, "detail": sup.detail})
        if sup.engine is None:
            return
        if sup.state is EngineState.RUNNING and sup.spec.kv_events and name not in self._relayed:
            self._relayed.add(name)
            for source in sup.spec.kv_events:
                for relay in self.relays:
                    relay.add_source(
                        sup.spec.events_instance or name, sup.engine.model, sup.engine.block_size, source.dp_rank,
                        source.endpoint, source.replay_endpoint,
                    )  # fmt: skip
        elif sup.state is not EngineState.RUNNING and name in self._relayed:
            self._relayed.discard(name)
            for relay in self.relays:
                relay.remove_source(sup.spec.events_instance or name)
        await self.link.changed(sup)

    def prepare(self) -> None:
        """Checks every service before anything starts (ServiceError names what is missing)."""
        for service in self.services:
            service.prepare()

    async def start(self) -> None:
        """Launches the services in order (store first) and the links."""
        self._tasks.append(asyncio.create_task(self.link.run()))
        self._tasks.extend(asyncio.create_task(relay.run()) for relay in self.relays)
        for service in self.services:
            log.info(
                "launching service", extra={"service": service.name, "processes": len(service.supervisors)}
            )
            await service.launch()

    async def stop(self, stop_engines: bool | None = None) -> None:
        """With `stop_engines` (default: `stop_engines_on_exit`), deregisters and stops every engine, then the store; otherwise leaves them
        running and registered (the coordinator keeps them while their lease lasts; the next agent adopts them and
        re-registers them). Then closes the links."""
        if self.stop_engines_on_exit if stop_engines is None else stop_engines:
            for iid in list(self.link.registered):
                await self.link.deregister(iid, "agent shutdown")
            for service in reversed(self.services):
                await service.stop()
        else:
            left = [name for name, sup in self.supervisors.items() if sup.running]
            for service in self.services:
                await service.detach()
            log.info("agent exits, engines left running for the next agent", extra={"engines": left})
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        for relay in self.relays:
            await relay.close()
        await self.link.close()


async def run(
    config: NodeAgentConfig,
    coordinator_address: str,
    conductor_address: str | list[str],
    source: str,
    placement: Placement | None = None,
    tls: TlsFiles | None = None,
    engine_env: dict[str, str] | None = None,
) -> None:
    """Serves one node until SIGTERM. The layer above resolves the addresses; `source` names the config file;
    with `tls`, every connection is mutual TLS and the NodeAgent service answers the operator only."""
    try:
        placement = placement or Placement.from_env()
        agent = NodeAgent(config, coordinator_address, conductor_address, placement, tls, engine_env)
        agent.prepare()
    except (LaunchError, ServiceError) as exc:
        raise ConfigError(f"{source}: node_agents {config.node_id!r}: {exc}") from None
    notify = SystemdNotify()
    REGISTRY.register(AgentCollector(agent))
    app = GrpcApp(
        f"node-agent {config.node_id}", config.listen, config.metrics_listen, grace=2.0, tls=tls, rules=RULES
    )

    def shutdown(stop_engines: bool) -> None:
        agent.stop_engines_on_exit = stop_engines
        # After the reply is on its way: the same clean path as SIGTERM.
        asyncio.get_running_loop().call_later(0.05, os.kill, os.getpid(), signal.SIGTERM)

    app.add_service(
        "tandem.v1.NodeAgent",
        node_agent_pb2_grpc.add_NodeAgentServicer_to_server,
        NodeAgentService(config.node_id, agent.supervisors, shutdown),
    )
    watchdog: list[asyncio.Task] = []

    async def started() -> None:
        await agent.start()
        watchdog.append(asyncio.create_task(notify.watchdog()))
        notify.ready(f"serving {config.listen}; {len(agent.supervisors)} process(es) supervised")

    async def stopping() -> None:
        notify.stopping()
        for task in watchdog:
            task.cancel()
        await agent.stop()

    app.on_stop(stopping)
    await app.run(started)

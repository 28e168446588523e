"""Local services of a node, each with prepare / launch / health / stop, chosen by configuration.

`services: engine` (the default), `kv_store`, or `engine,kv_store`. The registry below maps each name to its
class; a node's config activates them, no code changes. Start order is store first (engines of a combined node may
connect to it at start), stop order the reverse.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import shutil
import time
from collections.abc import Awaitable, Callable
from typing import Protocol

from node_agent.config import NodeAgentConfig
from node_agent.launch import LaunchSpec, Placement, build_launch
from node_agent.supervisor import EngineState, EngineSupervisor, SupervisorParams

OnChange = Callable[[EngineSupervisor], Awaitable[None]]


class ServiceError(Exception):
    """A service cannot be prepared (one line: which and why)."""


class LocalService(Protocol):
    """What the agent does with each local service."""

    name: str
    supervisors: list[EngineSupervisor]

    def prepare(self) -> None:
        """Checks and creates what the service needs before anything starts; raises ServiceError."""

    async def launch(self) -> None:
        """Starts its processes (supervised: restarted with backoff)."""

    def healthy(self) -> bool:
        """True when every process is RUNNING and healthy."""

    async def stop(self) -> None:
        """Stops its processes."""

    async def detach(self) -> None:
        """Ends supervision, leaving its processes running (recorded for the next agent to adopt)."""


def _executable_exists(argv0: str) -> bool:
    return os.path.isfile(argv0) if os.sep in argv0 else shutil.which(argv0) is not None


class _Supervised:
    name = ""

    def __init__(self) -> None:
        self.supervisors: list[EngineSupervisor] = []

    def healthy(self) -> bool:
        return all(s.state is EngineState.RUNNING and s.healthy for s in self.supervisors)

    async def launch(self) -> None:
        for sup in self.supervisors:
            sup.start(adopt=True)

    async def stop(self) -> None:
        await asyncio.gather(*(sup.stop() for sup in self.supervisors))

    async def detach(self) -> None:
        """Leaves the processes running for the next agent to adopt."""
        await asyncio.gather(*(sup.detach() for sup in self.supervisors))


class EngineService(_Supervised):
    """The node's engines: one supervisor per engine process (per local DP rank in external LB)."""

    name = "engine"

    def __init__(
        self, config: NodeAgentConfig, runtime_dir: str, placement: Placement, on_change: OnChange
    ) -> None:
        super().__init__()
        self.runtime_dir = runtime_dir
        params = SupervisorParams.from_config(config, runtime_dir)
        store_env = {}
        if config.kv_store is not None and "kv_store" in config.service_names:
            store_env = dict(config.kv_store.engine_env)
        for engine in config.engines:
            for spec in build_launch(engine, runtime_dir, placement):
                if store_env:
                    spec = dataclasses.replace(spec, env={**store_env, **spec.env})
                self.supervisors.append(EngineSupervisor(engine, spec, params, on_change))

    def prepare(self) -> None:
        os.makedirs(self.runtime_dir, exist_ok=True)
        for sup in self.supervisors:
            if not _executable_exists(sup.spec.argv[0]):
                backend = sup.engine.backend if sup.engine else "service"
                raise ServiceError(f"engine {sup.name!r}: {sup.spec.argv[0]!r} not found (backend {backend})")


class KvStoreService(_Supervised):
    """A KV store process (Mooncake master by default), healthy when its address accepts connections."""

    name = "kv_store"

    def __init__(
        self, config: NodeAgentConfig, runtime_dir: str, placement: Placement, on_change: OnChange
    ) -> None:
        super().__init__()
        store = config.kv_store
        assert store is not None  # checked by the config
        self.store = store
        self.runtime_dir = runtime_dir
        spec = LaunchSpec(name=f"{config.node_id}-kv_store", argv=list(store.argv), env=dict(store.env))
        params = SupervisorParams.from_config(config, runtime_dir)
        self.supervisors.append(
            EngineSupervisor(
                None,
                spec,
                params,
                on_change,
                health_timeout_s=store.health_timeout_s,
                tcp_health=store.health_address,
            )
        )

    def prepare(self) -> None:
        os.makedirs(self.runtime_dir, exist_ok=True)
        argv0 = self.store.argv[0]
        if not _executable_exists(argv0):
            raise ServiceError(f"kv_store: {argv0!r} not found")

    async def launch(self) -> None:
        await super().launch()
        # Engines of a combined node connect to the store at start: give it its health timeout to come up.
        deadline = time.monotonic() + self.store.health_timeout_s
        while not self.healthy() and time.monotonic() < deadline:
            if any(s.state is EngineState.FAILED for s in self.supervisors):
                return
            await asyncio.sleep(0.1)


SERVICE_TYPES: dict[str, type[EngineService] | type[KvStoreService]] = {
    "kv_store": KvStoreService,
    "engine": EngineService,
}


def build_services(
    config: NodeAgentConfig, runtime_dir: str, placement: Placement, on_change: OnChange
) -> list[LocalService]:
    """The services `config.services` activates, in start order."""
    return [SERVICE_TYPES[name](config, runtime_dir, placement, on_change) for name in config.service_names]

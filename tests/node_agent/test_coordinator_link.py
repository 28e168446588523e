"""The agent's link to the coordinator: a coordinator that comes back gets the agent's engines again within a
second, and a health change is reported at once, not at the next heartbeat interval."""

from __future__ import annotations

import asyncio
import contextlib

import grpc

from node_agent.config import EngineConfig, RestartPolicy
from node_agent.coordinator_link import CoordinatorLink
from node_agent.launch import LaunchSpec
from node_agent.supervisor import EngineState, EngineSupervisor, SupervisorParams
from tandem.v1 import registry_pb2_grpc
from tests.helpers import eventually, free_port
from tests.node_agent.test_supervision import FakeRegistry


async def serve(registry: FakeRegistry, port: int) -> grpc.aio.Server:
    server = grpc.aio.server()
    registry_pb2_grpc.add_RegistryServicer_to_server(registry, server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server


def running_engine(tmp_path) -> EngineSupervisor:
    async def changed(_: EngineSupervisor) -> None:
        pass

    engine = EngineConfig(instance_id="e", model="m", port=7001)
    params = SupervisorParams(RestartPolicy(), str(tmp_path), 0.5, 1)
    sup = EngineSupervisor(engine, LaunchSpec("e", ["true"], port=7001), params, changed)
    sup.state, sup.healthy = EngineState.RUNNING, True  # as after a launch: no process needed here
    return sup


async def test_engines_are_registered_again_within_a_second_of_the_coordinator_coming_back(tmp_path):
    port = free_port()
    sup = running_engine(tmp_path)
    first = FakeRegistry()
    server = await serve(first, port)
    link = CoordinatorLink(f"127.0.0.1:{port}", "n1", lambda: [sup])
    task = asyncio.create_task(link.run())
    try:
        await eventually(lambda: ("register", "e") in first.events, 5, "registered")
        await server.stop(0)  # the coordinator dies
        await eventually(lambda: not link.registered, 5, "loss noticed")
        # Down for a while: the agent's channel tries to connect five times in a row (each attempt accepted, then
        # cut), so gRPC's own reconnect backoff (1 s, then 1.6 s, 2.6 s, ...) would have grown far past a second.
        attempts = []

        def attempted(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            attempts.append(writer.get_extra_info("peername"))
            writer.close()

        dead = await asyncio.start_server(attempted, "127.0.0.1", port)
        await eventually(
            lambda: len(attempts) >= 5, 10, "five connection attempts while the coordinator is down"
        )
        dead.close()
        await dead.wait_closed()
        back = FakeRegistry()
        server = await serve(back, port)
        loop = asyncio.get_running_loop()
        started = loop.time()
        await eventually(lambda: ("register", "e") in back.events, 5, "registered again")
        assert loop.time() - started < 1.0
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await link.close()
        await server.stop(0)

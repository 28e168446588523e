"""The agent's link to the coordinator: a coordinator that comes back gets the agent's engines again within a
second, and a health change is reported at once, not at the next heartbeat interval."""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import pytest

from node_agent.app import NodeAgent
from node_agent.config import EngineConfig, RestartPolicy
from node_agent.coordinator_link import RECONNECT_S, CoordinatorLink, reconnect_delay
from node_agent.launch import LaunchSpec
from node_agent.supervisor import EngineState, EngineSupervisor, SupervisorParams
from tandem.v1 import registry_pb2_grpc
from tests.helpers import eventually, free_port
from tests.node_agent.test_adapters import LoadRegistry
from tests.node_agent.test_supervision import FakeRegistry, serving, sim_node


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


async def cut_connections(port: int, count: int, timeout: float) -> None:
    """A coordinator that is down: every connection to `port` accepted and cut at once, until `count` came."""
    attempts = []

    def attempted(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        attempts.append(writer.get_extra_info("peername"))
        writer.close()

    dead = await asyncio.start_server(attempted, "127.0.0.1", port)
    try:
        await eventually(
            lambda: len(attempts) >= count, timeout, f"{count} connection attempts while it is down"
        )
    finally:
        dead.close()
        await dead.wait_closed()


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
        await cut_connections(port, 5, 10)
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


@pytest.mark.parametrize("passes", [0, 1, 2, 3])
async def test_a_link_cancelled_as_it_is_woken_stops(tmp_path, passes):
    """The agent stops its link by cancelling it. A cancellation that arrives in the same loop pass as the wake it
    waits on (a health change, a registration) must still stop it: Python 3.11's `asyncio.wait_for` returned the
    wake and dropped the cancellation, so the link ran on and `await task` hung (it hung the CI run at 600 s)."""
    port = free_port()
    sup = running_engine(tmp_path)
    server = await serve(FakeRegistry(), port)
    link = CoordinatorLink(f"127.0.0.1:{port}", "n1", lambda: [sup])
    task = asyncio.create_task(link.run())
    try:
        await eventually(lambda: link.registered and link._outbox.empty(), 5, "heartbeats flowing")
        link._wake.set()
        for _ in range(passes):
            await asyncio.sleep(0)
        task.cancel()
        done, _ = await asyncio.wait([task], timeout=2)
        assert done, f"the link ran on after its cancellation ({passes} loop passes after the wake)"
    finally:
        task.cancel()
        await link.close()
        await server.stop(0)


class SlowBeatRegistry(FakeRegistry):
    """Asks for the coordinator's default heartbeat interval (2 s), so that nothing here rides on the interval."""

    async def Register(self, request, context):
        reply = await super().Register(request, context)
        reply.heartbeat_interval.FromMilliseconds(2000)
        return reply


async def test_a_restarted_coordinator_gets_the_engines_within_a_fraction_of_a_second(tmp_path):
    """A coordinator killed and started again (`tandem up`'s immediate restart): the agent notices the lost stream
    at once (not at its next 2 s heartbeat), waits for the coordinator to listen again rather than sleeping, and
    registers within a few of gRPC's 0.1 s connection retries of it listening. Bounded: one restart, 10 s at most.
    On main the loss was noticed at the next heartbeat interval (up to 2 s) and a registration that failed while
    the coordinator was down was tried again only after another interval."""
    port = free_port()
    sup = running_engine(tmp_path)
    first = SlowBeatRegistry()
    server = await serve(first, port)
    link = CoordinatorLink(f"127.0.0.1:{port}", "n1", lambda: [sup])
    task = asyncio.create_task(link.run())
    loop = asyncio.get_running_loop()
    try:
        await eventually(lambda: ("register", "e") in first.events, 5, "registered")
        await eventually(lambda: link._outbox is not None and link._outbox.empty(), 5, "heartbeats flowing")
        killed = loop.time()
        await server.stop(0)  # the coordinator dies
        await eventually(lambda: not link.registered, 5, "loss noticed")
        assert loop.time() - killed < 0.5, "the lost stream was noticed at the heartbeat interval"
        await cut_connections(port, 2, 5)  # down for a while, as while `tandem up` restarts it
        back = SlowBeatRegistry()
        server = await serve(back, port)
        listening = loop.time()
        await eventually(lambda: ("register", "e") in back.events, 5, "registered again")
        assert loop.time() - listening < 0.5, f"registered {loop.time() - listening:.2f}s after it listened"
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await link.close()
        await server.stop(0)


def test_only_a_stream_that_failed_at_once_is_reopened_after_a_pause():
    assert (
        reconnect_delay(30.0) == 0.0
    )  # it had lived: its coordinator went away, the new stream waits for it
    assert reconnect_delay(0.01) == RECONNECT_S  # refused at once: no busy loop


async def test_heartbeats_carry_the_engines_cache_size(tmp_path):
    """The coordinator's P/D sizing bounds a decode batch by each engine's KV blocks (`vllm:cache_config_info`): a
    simengine launched with `--npu-blocks 1024` is reported with 1,024. Bounded: one engine, 30 s at most."""
    async with serving(LoadRegistry()) as registry:
        config = sim_node(tmp_path, registry.address, "--speedup", "50", "--npu-blocks", "1024")
        agent = NodeAgent(config, registry.address, "127.0.0.1:1")
        await agent.start()
        try:
            await eventually(
                lambda: "sim-0" in registry.beats and registry.beats["sim-0"].load.kv_blocks == 1024,
                30,
                "a heartbeat with the engine's 1,024 blocks",
            )
        finally:
            await agent.stop()

"""Supervision with real processes: crash loop with backoff reported in status, drain, headless, KV store."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys

import grpc
import httpx
import pytest

from node_agent.app import NodeAgent
from node_agent.config import NodeAgentConfig, RestartPolicy
from node_agent.grpc_service import NodeAgentService
from node_agent.launch import LaunchSpec
from node_agent.processes import start_ticks
from node_agent.supervisor import (
    EngineState,
    EngineSupervisor,
    SupervisorParams,
    engine_idle,
    liveness_expired,
    same_load,
)
from tandem.engine_load import EngineLoad
from tandem.restarts import backoff_delay
from tandem.v1 import node_agent_pb2, node_agent_pb2_grpc, registry_pb2, registry_pb2_grpc
from tests.helpers import eventually, free_ports


class FakeRegistry(registry_pb2_grpc.RegistryServicer):
    """Records what the agent tells the coordinator."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str]] = []
        self.instances: dict[str, object] = {}

    async def Register(self, request, context):
        self.events.append(("register", request.instance.instance_id))
        self.instances[request.instance.instance_id] = request.instance
        reply = registry_pb2.RegisterResponse()
        reply.heartbeat_interval.FromMilliseconds(200)
        return reply

    async def Deregister(self, request, context):
        self.events.append(("deregister", request.instance_id))
        return registry_pb2.DeregisterResponse(found=True)

    async def Heartbeat(self, request_iterator, context):
        async for beat in request_iterator:
            yield registry_pb2.HeartbeatResponse(instance_id=beat.instance_id, known=True)


@contextlib.asynccontextmanager
async def serving(fake):
    """`fake` (a Registry servicer) on a free loopback port, its address in `fake.address`."""
    server = grpc.aio.server()
    registry_pb2_grpc.add_RegistryServicer_to_server(fake, server)
    fake.address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    await server.start()
    try:
        yield fake
    finally:
        await server.stop(0)


@pytest.fixture
async def registry():
    async with serving(FakeRegistry()) as fake:
        yield fake


def test_backoff_doubles_up_to_the_cap():
    policy = RestartPolicy(initial_backoff_s=0.5, max_backoff_s=3)
    assert [backoff_delay(policy, n) for n in (1, 2, 3, 4, 5)] == [0.5, 1.0, 2.0, 3.0, 3.0]


async def test_crash_loop_backs_off_and_gives_up_reported_in_status(tmp_path):
    seen: list[tuple[EngineState, str, float]] = []
    loop = asyncio.get_running_loop()

    async def changed(sup: EngineSupervisor) -> None:
        seen.append((sup.state, sup.detail, loop.time()))

    crash = [sys.executable, "-c", "import sys; sys.exit(3)"]
    policy = RestartPolicy(
        initial_backoff_s=0.1, max_backoff_s=0.2, max_consecutive_failures=4, stable_after_s=60
    )
    sup = EngineSupervisor(
        None, LaunchSpec("crashy", crash), SupervisorParams(policy, str(tmp_path), 0.1, 1), changed
    )
    sup.start()
    await eventually(lambda: sup.state is EngineState.FAILED, 20, "FAILED")
    backoffs = [(detail, t) for state, detail, t in seen if state is EngineState.BACKOFF]
    assert [d for d, _ in backoffs] == [
        "exited with code 3, restart in 0.1s",
        "exited with code 3, restart in 0.2s",
        "exited with code 3, restart in 0.2s",
    ]
    assert sup.restarts == 3 and sup.last_exit_code == 3
    assert "4 failures in a row, not restarting" in sup.detail
    status = (await NodeAgentService("n1", {"crashy": sup}).GetStatus(None, None)).engines[0]
    assert status.state == node_agent_pb2.ENGINE_STATE_FAILED and status.restarts == 3
    assert status.last_exit_code == 3 and "not restarting" in status.detail and status.pid == 0


def sim_node(tmp_path, registry_address: str, *engine_args: str, **engine_fields) -> NodeAgentConfig:
    ports = free_ports(3)
    return NodeAgentConfig(
        node_id="n1",
        listen=f"127.0.0.1:{ports[0]}",
        metrics_listen=f"127.0.0.1:{ports[1]}",
        runtime_dir=str(tmp_path / "rt"),
        probe_interval_s=0.2,
        stop_grace_s=5,
        restart={"initial_backoff_s": 0.1, "max_backoff_s": 0.2, "max_consecutive_failures": 2},
        engines=[
            {
                "instance_id": "sim-0",
                "model": "tandem-sim",
                "port": ports[2],
                "args": list(engine_args),
                "kv_events": False,
                **engine_fields,
            }
        ],  # fmt: skip
    )


async def test_simengine_crashing_after_requests_is_restarted_then_failed(tmp_path, registry):
    config = sim_node(tmp_path, registry.address, "--fault-crash-after", "1", "--speedup", "50")
    agent = NodeAgent(config, registry.address, "127.0.0.1:1")
    sup = agent.supervisors["sim-0"]
    await agent.start()
    try:
        async with httpx.AsyncClient(timeout=10) as http:
            for round_ in range(2):
                await eventually(lambda: sup.state is EngineState.RUNNING, 30, f"running (round {round_})")
                for _ in range(2):  # the second request makes simengine exit(1)
                    with contextlib.suppress(httpx.HTTPError):
                        await http.post(
                            f"{sup.base_url}/v1/completions", json={"model": "tandem-sim", "prompt": "hi"}
                        )
                await eventually(lambda: sup.state is not EngineState.RUNNING, 10, "crash noticed")
        await eventually(lambda: sup.state is EngineState.FAILED, 20, "FAILED after the limit")
        assert sup.restarts == 1 and sup.last_exit_code == 1
        # Deregistered in the end, also when the engine crashed while its registration was still on the wire.
        await eventually(lambda: registry.events[-1] == ("deregister", "sim-0"), 5, "deregistered at the end")
        events = registry.events
        assert events[:2] == [("register", "sim-0"), ("deregister", "sim-0")]
        # Each registration is followed by its deregistration (the restarted engine's may be skipped when it
        # crashed before its registration went out, as under load).
        assert all(a != b for a, b in zip(events, events[1:], strict=False)), events
    finally:
        await agent.stop(stop_engines=True)


def test_liveness_needs_the_timeout_of_silence_and_two_failed_probes_in_a_row():
    assert not liveness_expired(
        answered_at=10.0, now=12.9, failed_probes=3, timeout_s=3.0
    )  # not silent long enough
    assert liveness_expired(answered_at=10.0, now=13.0, failed_probes=2, timeout_s=3.0)
    # The agent itself was frozen 5 s: its first probe after the thaw fails on its own account; no kill for that.
    assert not liveness_expired(answered_at=10.0, now=15.5, failed_probes=1, timeout_s=3.0)
    assert not liveness_expired(answered_at=10.0, now=60.0, failed_probes=9, timeout_s=None)  # liveness off


def test_an_engine_is_idle_with_nothing_queued_and_no_progress_since_the_last_read():
    quiet = EngineLoad(progress={0: (120, 40)}, sampled_at=1.0)
    assert engine_idle(quiet, EngineLoad(progress={0: (120, 40)}, sampled_at=2.0))
    assert not engine_idle(quiet, EngineLoad(progress={0: (120, 41)}))  # a token since: it worked in between
    assert not engine_idle(quiet, EngineLoad(running=1, progress={0: (120, 40)}))
    assert not engine_idle(quiet, EngineLoad(waiting=1, progress={0: (120, 40)}))
    assert not engine_idle(EngineLoad(), EngineLoad(progress={0: (0, 0)}))  # the first read after a (re)start
    assert same_load(
        quiet, EngineLoad(progress={0: (120, 40)}, sampled_at=9.0)
    )  # only the read's time differs
    assert not same_load(quiet, EngineLoad(progress={0: (120, 40)}, kv_cache_usage=0.5))


async def test_an_idle_engine_is_read_and_probed_seldom_and_often_again_when_it_works(tmp_path, registry):
    """Idle, an engine is read every `idle_load_interval_s` (30 s here) instead of every `load_interval_s` (0.1 s)
    and probed every `idle_probe_interval_s` (30 s) instead of every `probe_interval_s` (0.1 s); the KV events of a
    request that computes new blocks bring a read at once, and reads and probes at the short intervals while it
    works; done, it is idle again. Bounded: one engine, one request, about 10 s."""
    config = sim_node(tmp_path, registry.address, "--speedup", "5", kv_events=True).model_copy(
        update={
            "load_interval_s": 0.1,
            "idle_load_interval_s": 30.0,
            "probe_interval_s": 0.1,
            "idle_probe_interval_s": 30.0,
        }
    )
    agent = NodeAgent(config, registry.address, "127.0.0.1:1")
    sup = agent.supervisors["sim-0"]
    await agent.start()
    try:
        await eventually(lambda: sup.state is EngineState.RUNNING and sup.scrapes >= 2, 30, "read twice")
        await eventually(lambda: sup.idle, 5, "a read that finds it idle")
        await asyncio.sleep(0.2)  # the probe already due when it was found idle
        before, probes = sup.scrapes, sup.probes
        # An observation window: at the short intervals it would hold 10 reads and probes.
        await asyncio.sleep(1.0)
        assert sup.scrapes == before, "an idle engine read again before idle_load_interval_s"
        assert sup.probes == probes, "an idle engine probed again before idle_probe_interval_s"
        prompt = " ".join(f"word{i}" for i in range(300))  # ~19 blocks to compute: KV events
        async with httpx.AsyncClient(timeout=30) as http:
            sent = asyncio.create_task(
                http.post(
                    f"{sup.base_url}/v1/completions",
                    # 320 tokens keep it working ~1.5 s at speedup 5 (64 took ~0.3 s: 2 reads where 3 were asserted)
                    json={"model": "tandem-sim", "prompt": prompt, "max_tokens": 320, "ignore_eos": True},
                )
            )
            await eventually(lambda: sup.scrapes > before, 3, "a read once the engine works")
            await eventually(lambda: sup.load.running or sup.load.waiting, 3, "the request seen running")
            reply = await sent
            assert reply.status_code == 200, reply.text
        assert sup.scrapes >= before + 3, sup.scrapes - before  # read at load_interval_s while it worked
        assert sup.probes >= probes + 3, sup.probes - probes  # probed at probe_interval_s while it worked
        await eventually(lambda: sup.idle, 3, "a read that finds it idle again")
        await asyncio.sleep(0.2)
        quiet, probes = sup.scrapes, sup.probes
        await asyncio.sleep(1.0)  # the same window, after the work
        assert sup.scrapes == quiet, sup.scrapes - quiet
        assert sup.probes == probes, sup.probes - probes
    finally:
        await agent.stop(stop_engines=True)


async def test_frozen_engine_is_reported_unresponsive_then_killed_and_restarted(tmp_path, registry):
    """SIGSTOP: within a probe interval plus its timeout the engine is UNRESPONSIVE (not RUNNING, not routed, still
    registered); after `liveness_timeout_s` without an answer it is killed (its connections close, so its requests
    end) and restarted. Bounded: one engine, 20 s at most. On main it stayed RUNNING until it was continued."""
    config = sim_node(tmp_path, registry.address, "--speedup", "50").model_copy(
        update={"probe_timeout_s": 0.5, "liveness_timeout_s": 2.0}
    )
    agent = NodeAgent(config, registry.address, "127.0.0.1:1")
    sup = agent.supervisors["sim-0"]
    service = NodeAgentService("n1", agent.supervisors)
    await agent.start()
    try:
        await eventually(lambda: sup.state is EngineState.RUNNING and sup.healthy, 30, "running")
        pid = sup.process.pid
        loop = asyncio.get_running_loop()
        frozen_at = loop.time()
        os.kill(pid, signal.SIGSTOP)
        await eventually(lambda: not sup.healthy, 5, "unresponsive")
        assert loop.time() - frozen_at < 1.5
        status = (await service.GetStatus(node_agent_pb2.GetStatusRequest(), None)).engines[0]
        assert status.state == node_agent_pb2.ENGINE_STATE_UNRESPONSIVE and "unresponsive" in status.detail
        assert registry.events == [("register", "sim-0")]  # still registered: only its health changed
        await eventually(lambda: sup.process is None or sup.process.pid != pid, 10, "killed")
        killed_s = loop.time() - frozen_at
        assert killed_s < 4.0, killed_s  # 2 s of silence plus a probe, not "until it thaws"
        await eventually(lambda: sup.state is EngineState.RUNNING and sup.healthy, 30, "restarted")
        assert sup.restarts == 1 and sup.last_exit_code == -signal.SIGKILL
        # The agent registers it again once healthy: that call may still be on the wire when `healthy` turns true.
        await eventually(lambda: registry.events[-1] == ("register", "sim-0"), 5, "registered again")
        assert ("deregister", "sim-0") in registry.events
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
        await agent.stop(stop_engines=True)


async def test_liveness_off_leaves_a_frozen_engine_unresponsive(tmp_path, registry):
    config = sim_node(tmp_path, registry.address, "--speedup", "50").model_copy(
        update={"probe_timeout_s": 0.3, "liveness_timeout_s": None}
    )
    agent = NodeAgent(config, registry.address, "127.0.0.1:1")
    sup = agent.supervisors["sim-0"]
    await agent.start()
    try:
        await eventually(lambda: sup.state is EngineState.RUNNING and sup.healthy, 30, "running")
        pid = sup.process.pid
        loop = asyncio.get_running_loop()
        frozen_at = loop.time()
        os.kill(pid, signal.SIGSTOP)
        await eventually(lambda: sup.reported_state is EngineState.UNRESPONSIVE, 5, "unresponsive")
        await eventually(lambda: loop.time() - frozen_at > 3.0, 5, "frozen past the default liveness timeout")
        assert sup.restarts == 0 and sup.process.pid == pid and sup.reported_state is EngineState.UNRESPONSIVE
        os.kill(pid, signal.SIGCONT)
        await eventually(lambda: sup.reported_state is EngineState.RUNNING, 5, "answers again")
        assert sup.restarts == 0 and sup.process.pid == pid
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
        await agent.stop(stop_engines=True)


async def test_drain_deregisters_waits_for_in_flight_then_stops(tmp_path, registry):
    config = sim_node(tmp_path, registry.address, "--speedup", "4")
    agent = NodeAgent(config, registry.address, "127.0.0.1:1")
    sup = agent.supervisors["sim-0"]
    await agent.start()
    server = grpc.aio.server()
    node_agent_pb2_grpc.add_NodeAgentServicer_to_server(NodeAgentService("n1", agent.supervisors), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        await eventually(lambda: ("register", "sim-0") in registry.events, 30, "registration")
        instance = registry.instances["sim-0"]
        assert (
            instance.dispatch_capability == 1
            and instance.data_parallel_size == 1
            and instance.kv_connector == ""
        )
        async with httpx.AsyncClient(timeout=60) as http:
            body = {
                "model": "tandem-sim",
                "prompt": "a long answer please",
                "max_tokens": 400,  # still decoding when the drain is seen, also on a busy machine
                "ignore_eos": True,
            }
            request = asyncio.create_task(http.post(f"{sup.base_url}/v1/completions", json=body))
            await eventually(lambda: sup.in_flight > 0 or request.done(), 10, "request in flight")
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = node_agent_pb2_grpc.NodeAgentStub(channel)
                drain = asyncio.ensure_future(
                    stub.Drain(node_agent_pb2.DrainRequest(instance_id="sim-0"), timeout=60)
                )
                await eventually(lambda: ("deregister", "sim-0") in registry.events, 5, "deregistration")
                assert sup.state is EngineState.DRAINING and not request.done()
                reply = await drain
            answer = await request
        assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 400
        assert reply.engine.state == node_agent_pb2.ENGINE_STATE_STOPPED and reply.engine.detail.startswith(
            "drained in"
        )
        assert sup.process.returncode is not None and sup.state is EngineState.STOPPED
    finally:
        await server.stop(0)
        await agent.stop(stop_engines=True)


async def test_drain_timeout_stops_anyway(tmp_path, registry):
    config = sim_node(tmp_path, registry.address, "--speedup", "1", drain_timeout_s=0.5)
    agent = NodeAgent(config, registry.address, "127.0.0.1:1")
    sup = agent.supervisors["sim-0"]
    await agent.start()
    try:
        await eventually(lambda: sup.state is EngineState.RUNNING, 30, "running")
        async with httpx.AsyncClient(timeout=60) as http:
            body = {"model": "tandem-sim", "prompt": "x", "max_tokens": 2000, "ignore_eos": True}
            request = asyncio.create_task(http.post(f"{sup.base_url}/v1/completions", json=body))
            await eventually(lambda: sup.in_flight > 0, 10, "request in flight")
            result = await sup.drain(config.engines[0].drain_timeout_s)
            with pytest.raises(httpx.HTTPError):
                await request
        assert not result.drained and result.in_flight == 1
        assert "drain timed out" in sup.detail and sup.state is EngineState.STOPPED
    finally:
        await agent.stop(stop_engines=True)


async def test_kv_store_separated_runs_the_store_only(tmp_path, registry):
    store_port, listen_port, metrics_port, engine_port = free_ports(4)  # one call: no two come out the same
    server = (
        f"import socket,time;s=socket.socket();s.bind(('127.0.0.1',{store_port}));s.listen();time.sleep(60)"
    )
    config = NodeAgentConfig(
        node_id="store",
        listen=f"127.0.0.1:{listen_port}",
        metrics_listen=f"127.0.0.1:{metrics_port}",
        runtime_dir=str(tmp_path / "rt"),
        probe_interval_s=0.2,
        services="kv_store",
        kv_store={
            "mode": "separated",
            "argv": [sys.executable, "-c", server],
            "health_address": f"127.0.0.1:{store_port}",
        },  # fmt: skip
        engines=[{"instance_id": "never", "model": "m", "port": engine_port}],
    )
    agent = NodeAgent(config, registry.address, "127.0.0.1:1")
    assert list(agent.supervisors) == ["store-kv_store"]  # no engine in separated mode
    agent.prepare()
    await agent.start()  # returns once the store accepts connections
    try:
        sup = agent.supervisors["store-kv_store"]
        assert sup.state is EngineState.RUNNING and sup.healthy and not sup.registrable
        # Registration happens in the RUNNING transition (awaited before start returned) or in the link's
        # reconcile loop, which only ever looks at the agent's registrable processes: there are none.
        assert agent.link.supervisors() == [] and registry.events == []
    finally:
        await agent.stop(stop_engines=True)
    assert agent.supervisors["store-kv_store"].state is EngineState.STOPPED


async def test_combined_store_env_reaches_engines_and_missing_binaries_fail_prepare(tmp_path, registry):
    from node_agent.local_services import ServiceError

    ports = free_ports(3)
    config = NodeAgentConfig(
        node_id="both",
        listen=f"127.0.0.1:{ports[0]}",
        metrics_listen=f"127.0.0.1:{ports[1]}",
        runtime_dir=str(tmp_path / "rt"),
        services="engine,kv_store",
        kv_store={
            "argv": ["no-such-store-binary"],
            "engine_env": {"MOONCAKE_CONFIG_PATH": "/etc/mooncake.json"},
        },
        engines=[{"instance_id": "e", "model": "m", "port": ports[2]}],
    )
    agent = NodeAgent(config, registry.address, "127.0.0.1:1")
    assert [s.name for s in agent.services] == ["kv_store", "engine"]
    assert agent.supervisors["e"].spec.env == {"MOONCAKE_CONFIG_PATH": "/etc/mooncake.json"}
    with pytest.raises(ServiceError, match="kv_store: 'no-such-store-binary' not found"):
        agent.prepare()


async def test_a_new_agent_adopts_the_engines_of_the_one_that_exited(tmp_path, registry):
    config = sim_node(tmp_path, registry.address, "--speedup", "50")
    first = NodeAgent(config, registry.address, "127.0.0.1:1")
    await first.start()
    sup = first.supervisors["sim-0"]
    await eventually(lambda: ("register", "sim-0") in registry.events, 30, "running and registered")
    pid = sup.process.pid
    await first.stop()  # an agent restart: the engine keeps running, recorded in the state directory
    assert os.path.exists(f"/proc/{pid}")
    assert ("deregister", "sim-0") not in registry.events
    registry.events.clear()

    second = NodeAgent(config, registry.address, "127.0.0.1:1")
    await second.start()
    adopted = second.supervisors["sim-0"]
    try:
        await eventually(lambda: ("register", "sim-0") in registry.events, 30, "re-registered")
        assert adopted.process.pid == pid and adopted.adopted and adopted.state is EngineState.RUNNING
        status = (await NodeAgentService("n1", second.supervisors).GetStatus(None, None)).engines[0]
        assert status.adopted and status.pid == pid and status.restarts == 0
        async with httpx.AsyncClient(timeout=10) as http:
            reply = await http.post(
                f"{adopted.base_url}/v1/completions",
                json={"model": "tandem-sim", "prompt": "hi", "max_tokens": 2},
            )
        assert reply.status_code == 200
        # An adopted engine that dies is noticed (pidfd) and launched again by the adopting agent.
        os.kill(pid, signal.SIGKILL)
        await eventually(lambda: adopted.running and adopted.process.pid != pid, 30, "relaunched")
        assert not adopted.adopted and adopted.restarts == 1
    finally:
        await second.stop(stop_engines=True)
    assert not any(os.scandir(config.state_path))  # stopped on request: nothing left to adopt


async def test_a_recorded_engine_launched_differently_is_replaced(tmp_path, registry):
    config = sim_node(tmp_path, registry.address, "--speedup", "50")
    first = NodeAgent(config, registry.address, "127.0.0.1:1")
    await first.start()
    await eventually(lambda: first.supervisors["sim-0"].state is EngineState.RUNNING, 30, "running")
    old = first.supervisors["sim-0"].process.pid
    await first.stop()
    changed = config.model_copy(deep=True)
    changed.engines[0].args = ["--speedup", "40"]  # the config changed while no agent ran
    second = NodeAgent(changed, registry.address, "127.0.0.1:1")
    await second.start()
    sup = second.supervisors["sim-0"]
    try:
        await eventually(lambda: sup.state is EngineState.RUNNING, 30, "running")
        assert (
            sup.process.pid != old and not sup.adopted and start_ticks(old) is None
        )  # stopped (a zombie here: our child)
    finally:
        await second.stop(stop_engines=True)


def test_load_from_vllm_metrics_text():
    from tandem.engine_load import parse_load

    text = """# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 2.0
vllm:num_requests_running{engine="1",model_name="tiny"} 1.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="tiny"} 3.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="tiny"} 0.5
"""
    load = parse_load(text)
    assert (load.running, load.waiting, load.kv_cache_usage) == (3, 3, 0.5) and load.sampled_at > 0

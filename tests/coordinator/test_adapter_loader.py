"""Placement's shell: the coordinator loads a request's adapter onto the chosen engine through its node's agent
(`NodeAgent.LoadAdapter` with the `tandem-node` header), one load per (instance, adapter), at most N at once,
within a deadline; a failed load answers the request with OpenAI-style JSON, releases its workload and holds the
instance back for that adapter. Every test is bounded by the loader's own deadline and a handful of requests."""

import asyncio
import json

import grpc
import pytest

from coordinator.adapter_loader import NODE_HEADER, AdapterLoader
from coordinator.adapter_placement import AdapterHolds
from coordinator.config import AdapterPlacementSettings
from coordinator.errors import OpenAIError
from coordinator.instances import InstanceInfo
from mesh.envoy import NODE_HEADER as ENVOY_NODE_HEADER
from tandem.engine_load import EngineLoad
from tandem.v1 import node_agent_pb2, node_agent_pb2_grpc
from tests.coordinator.test_ext_proc import body_message, decider_for, decision_metadata, process
from tests.helpers import make_picker


class FakeAgent(node_agent_pb2_grpc.NodeAgentServicer):
    """Answers LoadAdapter after `delay_s` with `code` (OK: loaded), recording calls and the most at once."""

    def __init__(self, delay_s: float = 0.0, code: grpc.StatusCode = grpc.StatusCode.OK) -> None:
        self.delay_s = delay_s
        self.code = code
        self.calls: list[tuple[str, str, str, str]] = []  # (node header, instance, adapter, path)
        self.unloads: list[tuple[str, str]] = []  # (instance, adapter)
        self.order: list[str] = []  # "load a", "unload b", ... as they finish
        self.now = self.most = 0

    async def _work(self) -> None:
        """One call's `delay_s`, counted in `now` and `most` while it runs."""
        self.now += 1
        self.most = max(self.most, self.now)
        try:
            await asyncio.sleep(self.delay_s)
        finally:
            self.now -= 1

    async def UnloadAdapter(self, request, context):
        await self._work()
        self.unloads.append((request.instance_id, request.adapter_name))
        self.order.append(f"unload {request.adapter_name}")
        return node_agent_pb2.UnloadAdapterResponse()

    async def LoadAdapter(self, request, context):
        node = dict(context.invocation_metadata()).get(NODE_HEADER, "")
        self.calls.append((node, request.instance_id, request.adapter_name, request.adapter_path))
        await self._work()
        if self.code != grpc.StatusCode.OK:
            await context.abort(self.code, f"no adapter found at {request.adapter_path}")
        self.order.append(f"load {request.adapter_name}")
        return node_agent_pb2.LoadAdapterResponse(loaded_adapters=[request.adapter_name])


@pytest.fixture
async def agent_server():
    servers = []

    async def start(fake: FakeAgent) -> str:
        server = grpc.aio.server()
        node_agent_pb2_grpc.add_NodeAgentServicer_to_server(fake, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        servers.append(server)
        return f"127.0.0.1:{port}"

    yield start
    for server in servers:
        await server.stop(0)


def loader_for(address: str, **settings) -> AdapterLoader:
    s = AdapterPlacementSettings(**settings)
    holds = AdapterHolds(s.failed_hold_s, s.loaded_memory_s)
    return AdapterLoader(
        address, None, s, holds, {"a": "/adapters/a", "b": "/adapters/b", "c": "/adapters/c"}
    )


def picker_with(*adapters: str, max_loras: int = 4):
    picker = make_picker(instances=2)
    picker.adapters = {"a": "m", "b": "m", "c": "m"}
    for state in picker.instances.all():
        state.info = InstanceInfo(
            state.info.instance_id, "m", state.info.address, "hybrid", "aggregated", node_id="node-1"
        )
        state.load = EngineLoad(adapters=frozenset(adapters), max_loras=max_loras)
    return picker


def test_the_node_header_is_the_one_envoys_control_listener_routes_by():
    assert NODE_HEADER == ENVOY_NODE_HEADER


async def test_a_resident_adapter_is_not_loaded_and_a_burst_shares_one_load(agent_server):
    fake = FakeAgent(delay_s=0.2)
    loader = loader_for(await agent_server(fake))
    state = picker_with("a").instances.get("i0")
    await loader.ensure(state, "a")  # listed by the heartbeat: nothing to do
    assert fake.calls == []
    await asyncio.wait_for(asyncio.gather(*(loader.ensure(state, "b") for _ in range(5))), 5)
    assert fake.calls == [("node-1", "i0", "b", "/adapters/b")]
    await loader.ensure(state, "b")  # loaded lately: resident until the heartbeat lists it
    assert len(fake.calls) == 1 and loader.loads_in_flight == 0
    await loader.close()


async def test_at_most_max_loads_in_flight(agent_server):
    fake = FakeAgent(delay_s=0.2)
    loader = loader_for(await agent_server(fake), max_loads_in_flight=1)
    picker = picker_with()
    i0, i1 = picker.instances.get("i0"), picker.instances.get("i1")
    loads = [loader.ensure(i0, "a"), loader.ensure(i1, "a"), loader.ensure(i0, "b")]
    await asyncio.wait_for(asyncio.gather(*loads), 5)
    assert len(fake.calls) == 3 and fake.most == 1
    await loader.close()


async def test_a_late_load_is_503_within_its_deadline_and_holds_the_instance_back(agent_server):
    fake = FakeAgent(delay_s=5.0)
    loader = loader_for(await agent_server(fake), load_timeout_s=0.3)
    state = picker_with().instances.get("i0")
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(OpenAIError) as info:
        await asyncio.wait_for(loader.ensure(state, "a"), 3)
    assert loop.time() - started < 2
    assert info.value.status == 503 and "took longer than 0.3 s" in info.value.message
    assert loader.holds.held_back("a", loop.time()) == {"i0"}
    await loader.close()


async def test_a_refused_load_is_500_with_the_agents_reason(agent_server):
    fake = FakeAgent(code=grpc.StatusCode.NOT_FOUND)
    loader = loader_for(await agent_server(fake))
    state = picker_with().instances.get("i1")
    with pytest.raises(OpenAIError) as info:
        await asyncio.wait_for(loader.ensure(state, "c"), 5)
    assert info.value.status == 500
    assert (
        "`c` could not be loaded" in info.value.message
        and "no adapter found at /adapters/c" in info.value.message
    )
    error = json.loads(info.value.body())["error"]
    assert error["type"] == "InternalServerError"
    await loader.close()


async def test_the_decision_loads_before_routing_and_a_failed_load_releases_the_request(agent_server):
    ok = FakeAgent()
    picker = picker_with("a")
    decider = decider_for(picker)
    decider.loader = loader_for(await agent_server(ok))
    picker.placement = decider.loader.holds
    request = {"model": "b", "prompt": "hello", "max_tokens": 4}
    (reply,) = await asyncio.wait_for(process(decider, body_message(request)), 5)
    assert reply.HasField("dynamic_metadata") and len(ok.calls) == 1
    assert not reply.request_body.response.HasField("body_mutation")  # the engine gets `model: b` as sent

    broken = FakeAgent(code=grpc.StatusCode.NOT_FOUND)
    decider.loader = loader_for(await agent_server(broken))
    picker.placement = decider.loader.holds
    before = picker.ledger.total_requests
    (reply,) = await asyncio.wait_for(process(decider, body_message({**request, "model": "c"})), 5)
    assert reply.immediate_response.status.code == 500
    assert "`c` could not be loaded" in json.loads(reply.immediate_response.body)["error"]["message"]
    assert picker.ledger.total_requests == before  # its workload released
    # The instance it failed on is held back for `c`; the other is tried next, then a clear error for all.
    (second,) = await asyncio.wait_for(process(decider, body_message({**request, "model": "c"})), 5)
    assert second.immediate_response.status.code == 500
    assert {call[1] for call in broken.calls} == {"i0", "i1"}
    (third,) = await asyncio.wait_for(process(decider, body_message({**request, "model": "c"})), 5)
    assert (
        "could not be loaded on any instance" in json.loads(third.immediate_response.body)["error"]["message"]
    )
    assert len(broken.calls) == 2  # not retried while held back


async def test_past_its_slots_an_engine_unloads_its_least_recently_used_idle_adapter_after_the_load(
    agent_server,
):
    fake = FakeAgent(delay_s=0.05)
    loader = loader_for(await agent_server(fake))
    holds = loader.holds
    state = picker_with("a", "b", max_loras=2).instances.get("i0")
    holds.routed("i0", "a", 10.0)  # `a` has a request in flight; `b` is idle
    await asyncio.wait_for(loader.ensure(state, "c"), 5)
    assert holds.resident(state, loader._clock()) == {"a", "c"}  # `b` is gone at once: no request follows it
    await wait_for_unloads(loader)
    assert fake.unloads == [("i0", "b")] and fake.order == ["load c", "unload b"]
    # `b` again: loaded after the unload (one call at a time per instance), and now `c` is the idle one to go.
    holds.ended("i0", "a")
    holds.routed("i0", "a", 20.0)
    await asyncio.wait_for(loader.ensure(state, "b"), 5)
    await wait_for_unloads(loader)
    assert fake.order == ["load c", "unload b", "load b", "unload c"]
    assert holds.resident(state, loader._clock()) == {"a", "b"}
    await loader.close()


async def test_nothing_is_unloaded_while_every_other_adapter_has_requests_in_flight(agent_server):
    fake = FakeAgent()
    loader = loader_for(await agent_server(fake))
    state = picker_with("a", max_loras=1).instances.get("i1")
    loader.holds.routed("i1", "a", 1.0)
    await asyncio.wait_for(loader.ensure(state, "b"), 5)
    await wait_for_unloads(loader)
    assert fake.unloads == [] and loader.holds.resident(state, loader._clock()) == {"a", "b"}
    await loader.close()


async def wait_for_unloads(loader: AdapterLoader) -> None:
    """The loader's background unloads, done (bounded)."""
    await asyncio.wait_for(asyncio.gather(*loader._unloads), 5)


async def test_the_decision_counts_an_adapter_request_in_flight_until_it_ends(agent_server):
    picker = picker_with("a")
    decider = decider_for(picker)
    decider.loader = loader_for(await agent_server(FakeAgent()))
    picker.placement = decider.loader.holds
    (reply,) = await asyncio.wait_for(
        process(decider, body_message({"model": "a", "prompt": "hello", "max_tokens": 4})), 5
    )
    iid = next(
        s.info.instance_id
        for s in picker.instances.all()
        if s.info.address == decision_metadata(reply)["destination"]
    )
    assert decider.loader.holds.inflight(iid) == {"a": 1}
    assert decider.tickets.end(decision_metadata(reply)["ticket"])
    assert decider.loader.holds.inflight(iid) == {}

"""LoRA adapters on the node agent: what an engine's answers mean (pure), the configured adapters loaded into a
real simengine (a broken one skipped with its error, the engine serving the others), what the heartbeat reports,
and `NodeAgent.LoadAdapter` / `UnloadAdapter` (the coordinator's alone)."""

from __future__ import annotations

import json

import grpc
import httpx
import pytest

from node_agent.adapters import Outcome, check_name, check_path, load_result, served_adapters, unload_result
from node_agent.app import RULES, NodeAgent
from node_agent.coordinator_link import heartbeat_message
from node_agent.grpc_service import NodeAgentService
from tandem.authz import is_allowed
from tandem.v1 import node_agent_pb2, node_agent_pb2_grpc, registry_pb2
from tests.helpers import eventually
from tests.node_agent.test_supervision import FakeRegistry, serving, sim_node

# vLLM 0.32's answers, as CPU vLLM gave them (docs/simengine.md).
ALREADY = ('{"error":{"message":"The lora adapter \'a\' has already been loaded. If you want to load the adapter in '
           'place, set \'load_inplace\' to True.","type":"InvalidUserInput","param":null,"code":400}}')  # fmt: skip
NO_ADAPTER = ('{"error":{"message":"Loading lora bad failed: No adapter found for /nonexistent/x","type":'
              '"NotFoundError","param":null,"code":404}}')  # fmt: skip


@pytest.mark.parametrize(
    ("status", "body", "outcome"),
    [
        (200, "Success: LoRA adapter 'a' added successfully.", Outcome.OK),
        (400, ALREADY, Outcome.ALREADY_LOADED),
        (404, NO_ADAPTER, Outcome.NOT_FOUND),
        (
            400,
            '{"error":{"message":"The lora adapter \'m\' conflicts with a served base model.","type":'
            '"InvalidUserInput","param":null,"code":400}}',
            Outcome.INVALID,
        ),  # fmt: skip
        (
            500,
            '{"error":{"message":"LoRA rank 32 is greater than max_lora_rank 16.","type":"InternalServerError",'
            '"param":null,"code":500}}',
            Outcome.REFUSED,
        ),  # fmt: skip
        (404, '{"detail":"Not Found"}', Outcome.REFUSED),  # the routes are not mounted
    ],
)
def test_load_answers(status, body, outcome):
    result = load_result(status, body)
    assert result.outcome is outcome and result.message
    if status == 404 and outcome is Outcome.REFUSED:
        assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING" in result.message
    if outcome is Outcome.NOT_FOUND:
        assert result.message == "Loading lora bad failed: No adapter found for /nonexistent/x"


def test_unload_answers_listing_names_and_paths():
    assert unload_result(200, "Success: LoRA adapter 'a' removed successfully.").outcome is Outcome.OK
    gone = unload_result(
        404, '{"error":{"message":"The lora adapter \'a\' cannot be found.","type":"NotFoundError"}}'
    )
    assert gone.outcome is Outcome.NOT_FOUND and gone.message == "The lora adapter 'a' cannot be found."
    models = {"data": [{"id": "m", "parent": None}, {"id": "a", "parent": "m"}, {"id": "b", "parent": "m"}]}
    assert served_adapters(models) == ["a", "b"] and served_adapters({"oops": 1}) == []
    assert check_path("/models/loras/sql") is None and check_path("org/chat-lora") is None
    for bad in ("loras/sql/v2", "./sql", "/models/../etc", "https://x/y", "", "org/../x"):
        assert check_path(bad), bad
    assert check_name("sql-lora") is None and check_name("a,b") and check_name("a b") and check_name("")


def test_only_the_coordinator_may_place_adapters():
    for method in ("/tandem.v1.NodeAgent/LoadAdapter", "/tandem.v1.NodeAgent/UnloadAdapter"):
        assert is_allowed(RULES, method, "coordinator")
        assert not is_allowed(RULES, method, "operator") and not is_allowed(RULES, method, "agent/n1")
    assert is_allowed(RULES, "/tandem.v1.NodeAgent/Drain", "operator")
    assert not is_allowed(RULES, "/tandem.v1.NodeAgent/Drain", "coordinator")


class LoadRegistry(FakeRegistry):
    """Also keeps the last heartbeat of each instance."""

    def __init__(self) -> None:
        super().__init__()
        self.beats: dict[str, registry_pb2.HeartbeatRequest] = {}

    async def Heartbeat(self, request_iterator, context):
        async for beat in request_iterator:
            self.beats[beat.instance_id] = beat
            yield registry_pb2.HeartbeatResponse(instance_id=beat.instance_id, known=True)


@pytest.fixture
async def load_registry():
    async with serving(LoadRegistry()) as fake:
        yield fake


def adapter_dir(root, name: str, rank: int = 8) -> str:
    path = root / name
    path.mkdir()
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": 16}))
    return str(path)


async def test_configured_adapters_load_a_broken_one_is_skipped_and_rpcs_place_more(tmp_path, load_registry):
    """Bounded: one simengine, a few HTTP and gRPC calls, 30 s at most per wait. On main the engine is launched
    without LoRA and a request naming an adapter is 404."""
    good, other = adapter_dir(tmp_path, "good"), adapter_dir(tmp_path, "other")
    adapters = [{"name": "good", "path": good}, {"name": "broken", "path": str(tmp_path / "missing")},
                {"name": "too-big", "path": adapter_dir(tmp_path, "big", rank=64)},
                {"name": "lazy", "path": adapter_dir(tmp_path, "lazy"), "preload": False}]  # fmt: skip
    config = sim_node(tmp_path, load_registry.address, "--speedup", "50", adapters=adapters, max_loras=2)
    agent = NodeAgent(config, load_registry.address, "127.0.0.1:1")
    sup = agent.supervisors["sim-0"]
    await agent.start()
    server = grpc.aio.server()
    node_agent_pb2_grpc.add_NodeAgentServicer_to_server(NodeAgentService("n1", agent.supervisors), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        await eventually(lambda: sup.adapters == ["good"], 30, "the good adapter loaded and listed")
        assert set(sup.adapter_errors) == {"broken", "too-big"}  # `lazy` (preload: false) was not tried
        assert "No adapter found" in sup.adapter_errors["broken"]
        assert "greater than max_lora_rank 16" in sup.adapter_errors["too-big"]
        async with httpx.AsyncClient(timeout=10) as http:
            for model in ("tandem-sim", "good"):
                r = await http.post(f"{sup.base_url}/v1/completions", json={"model": model, "prompt": "hi"})
                assert r.status_code == 200 and r.json()["model"] == model
        load = heartbeat_message(sup).load
        assert list(load.loaded_adapters) == ["good"] and load.max_loras == 2
        await eventually(
            lambda: (
                "sim-0" in load_registry.beats
                and list(load_registry.beats["sim-0"].load.loaded_adapters) == ["good"]
            ),
            10,
            "a heartbeat naming the adapter",
        )

        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = node_agent_pb2_grpc.NodeAgentStub(channel)
            reply = await stub.LoadAdapter(
                node_agent_pb2.LoadAdapterRequest(
                    instance_id="sim-0", adapter_name="other", adapter_path=other
                ),
                timeout=10,
            )
            assert list(reply.loaded_adapters) == ["good", "other"] and sup.adapters == ["good", "other"]
            for request, code, words in (
                (dict(adapter_name="other", adapter_path=other), grpc.StatusCode.ALREADY_EXISTS, "already"),
                (dict(adapter_name="x", adapter_path=str(tmp_path / "none")), grpc.StatusCode.NOT_FOUND, "No adapter"),
                (dict(adapter_name="x", adapter_path="relative/dir/x"), grpc.StatusCode.INVALID_ARGUMENT, "absolute"),
                (dict(adapter_name="tandem-sim", adapter_path=other), grpc.StatusCode.INVALID_ARGUMENT, "conflicts"),
            ):  # fmt: skip
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await stub.LoadAdapter(
                        node_agent_pb2.LoadAdapterRequest(instance_id="sim-0", **request), timeout=10
                    )
                assert info.value.code() is code and words in info.value.details(), info.value.details()
            reply = await stub.UnloadAdapter(
                node_agent_pb2.UnloadAdapterRequest(instance_id="sim-0", adapter_name="good"), timeout=10
            )
            assert list(reply.loaded_adapters) == ["other"]
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.UnloadAdapter(
                    node_agent_pb2.UnloadAdapterRequest(instance_id="sim-0", adapter_name="good"), timeout=10
                )
            assert info.value.code() is grpc.StatusCode.NOT_FOUND
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.LoadAdapter(
                    node_agent_pb2.LoadAdapterRequest(
                        instance_id="nope", adapter_name="a", adapter_path=other
                    ),
                    timeout=10,
                )
            assert info.value.code() is grpc.StatusCode.NOT_FOUND
    finally:
        await server.stop(0)
        await agent.stop(stop_engines=True)


async def test_an_engine_without_lora_refuses_placement(tmp_path, load_registry):
    config = sim_node(tmp_path, load_registry.address, "--speedup", "50")
    agent = NodeAgent(config, load_registry.address, "127.0.0.1:1")
    server = grpc.aio.server()
    node_agent_pb2_grpc.add_NodeAgentServicer_to_server(NodeAgentService("n1", agent.supervisors), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    await agent.start()
    try:
        sup = agent.supervisors["sim-0"]
        await eventually(lambda: sup.healthy, 30, "engine healthy")
        assert heartbeat_message(sup).load.max_loras == 0 and not heartbeat_message(sup).load.loaded_adapters
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = node_agent_pb2_grpc.NodeAgentStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.LoadAdapter(
                    node_agent_pb2.LoadAdapterRequest(
                        instance_id="sim-0", adapter_name="a", adapter_path="/a"
                    ),
                    timeout=10,
                )
        assert info.value.code() is grpc.StatusCode.FAILED_PRECONDITION
        assert "not launched with LoRA" in info.value.details()
    finally:
        await server.stop(0)
        await agent.stop(stop_engines=True)

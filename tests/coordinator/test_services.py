"""The coordinator's gRPC surface: Registry calls without a server (grpcio-testing); Registry streams, Admin and
Metaserver errors on loopback as gRPC callers see them."""

from __future__ import annotations

import json

import grpc
import prometheus_client
import pytest
import yaml

from coordinator.app import build
from coordinator.capacity import Limits, prefill_capacity
from coordinator.config import CoordinatorConfig
from coordinator.instances import InstanceInfo, InstanceTable
from coordinator.services import RegistryService
from mesh.certs import ensure_certs
from mesh.config import parse_mesh_config
from tandem import tls
from tandem.v1 import (
    admin_pb2,
    admin_pb2_grpc,
    common_pb2,
    metaserver_pb2,
    metaserver_pb2_grpc,
    registry_pb2,
    registry_pb2_grpc,
)
from tests.helpers import ServicerCalls, mesh_config

REGISTRY = registry_pb2.DESCRIPTOR.services_by_name["Registry"]


async def applied(call, beat: registry_pb2.HeartbeatRequest) -> None:
    """Sends one heartbeat on `call` (a `Registry/Heartbeat` stream) and waits until the coordinator has applied it:
    a test that moves a fake clock between beats must not let the stream run ahead of the server, which reads the
    clock when it applies a beat."""
    await call.write(beat)
    assert (await call.read()).known


@pytest.fixture
async def channel(monkeypatch):
    monkeypatch.setenv("TANDEM_NO_BANNER", "1")
    config = mesh_config(engines=1)
    config["node_agents"] = []
    # The instances below are addresses where nothing answers: routable without the health probe
    # (tests/coordinator/test_admission.py has the probe's own tests).
    config["coordinator"]["probe_instances"] = False
    coordinator = build(parse_mesh_config(config, "mesh.yaml"))
    await coordinator.app.start()
    async with grpc.aio.insecure_channel(config["coordinator"]["listen"]) as ch:
        yield ch
    await coordinator.app.server.stop(0)


def instance(**fields) -> common_pb2.Instance:
    base = dict(
        instance_id="i0",
        model="tandem-sim",
        address="127.0.0.1:1",
        role=common_pb2.ROLE_HYBRID,
        dispatch_capability=common_pb2.DISPATCH_CAPABILITY_AGGREGATED,
    )
    return common_pb2.Instance(**{**base, **fields})


async def test_register_heartbeat_list_drain(channel):
    registry = registry_pb2_grpc.RegistryStub(channel)
    admin = admin_pb2_grpc.AdminStub(channel)
    reply = await registry.Register(registry_pb2.RegisterRequest(instance=instance()))
    assert reply.heartbeat_interval.ToMilliseconds() == 500

    async def beats():
        yield registry_pb2.HeartbeatRequest(
            instance_id="i0",
            health=common_pb2.HEALTH_HEALTHY,
            load=common_pb2.InstanceLoad(running_requests=3, kv_cache_usage=0.5),
        )
        yield registry_pb2.HeartbeatRequest(instance_id="ghost", health=common_pb2.HEALTH_HEALTHY)

    answers = [a async for a in registry.Heartbeat(beats())]
    assert [(a.instance_id, a.known) for a in answers] == [("i0", True), ("ghost", False)]
    listed = await admin.ListInstances(admin_pb2.ListInstancesRequest())
    (status,) = listed.instances
    assert status.load.running_requests == 3 and status.health == common_pb2.HEALTH_HEALTHY
    drained = await admin.DrainInstance(admin_pb2.DrainInstanceRequest(instance_id="i0"))
    assert drained.instance.drained
    assert not (
        await admin.UndrainInstance(admin_pb2.UndrainInstanceRequest(instance_id="i0"))
    ).instance.drained
    assert (await registry.Deregister(registry_pb2.DeregisterRequest(instance_id="i0"))).found


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"instance_id": ""}, "instance.instance_id is required"),
        ({"address": ""}, "instance.address is required"),
        ({"role": common_pb2.ROLE_UNSPECIFIED}, "instance.role must be set"),
        (
            {"dispatch_capability": common_pb2.DISPATCH_CAPABILITY_UNSPECIFIED},
            "dispatch_capability must be set",
        ),
    ],
)
def test_bad_registration_is_invalid_argument_and_registers_nothing(fields, message):
    table = InstanceTable(["tandem-sim"])
    call = ServicerCalls(REGISTRY, RegistryService(table, CoordinatorConfig()))
    reply, code, details = call("Register", registry_pb2.RegisterRequest(instance=instance(**fields)))
    assert reply is None and code == grpc.StatusCode.INVALID_ARGUMENT and message in details
    assert table.all() == []


def test_registration_round_trip_without_a_server():
    table = InstanceTable(["tandem-sim"])
    call = ServicerCalls(REGISTRY, RegistryService(table, CoordinatorConfig(heartbeat_interval_s=0.25)))
    reply, code, _ = call("Register", registry_pb2.RegisterRequest(instance=instance(address="127.0.0.1:7")))
    assert code == grpc.StatusCode.OK and reply.heartbeat_interval.ToMilliseconds() == 250
    assert [(s.info.instance_id, s.info.address) for s in table.all()] == [("i0", "127.0.0.1:7")]
    gone = registry_pb2.DeregisterRequest(instance_id="i0", reason="test")
    assert call("Deregister", gone)[0].found and not call("Deregister", gone)[0].found
    assert table.all() == []


async def test_admin_errors_and_config(channel):
    admin = admin_pb2_grpc.AdminStub(channel)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await admin.DrainInstance(admin_pb2.DrainInstanceRequest(instance_id="nope"))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND and "nope" in info.value.details()
    config = yaml.safe_load((await admin.GetConfig(admin_pb2.GetConfigRequest())).yaml)
    assert config["coordinator"]["scheduler"]["policy"] == "least_load"
    stats = await admin.GetStats(admin_pb2.GetStatsRequest())
    assert stats.policy == "least_load" and stats.workload_tokens == 0


async def test_metaserver_rejects_unknown_attempts(channel):
    """An id with no open attempt is refused exactly as a wrong token is (nothing tells a caller without a token
    which ids exist)."""
    stub = metaserver_pb2_grpc.MetaserverStub(channel)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.Trigger(metaserver_pb2.TriggerRequest(request_id="cmpl-x#a1-0", token="guess"))
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert info.value.details().endswith(
        "the callback URL's token does not belong to an open request attempt"
    )
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.Trigger(metaserver_pb2.TriggerRequest(request_id="cmpl-x#a1-0", replica="c7"))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND and "'c7'" in info.value.details()
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.Trigger(metaserver_pb2.TriggerRequest())
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_heartbeat_progress_takes_prefill_off_the_ledger(monkeypatch):
    monkeypatch.setenv("TANDEM_NO_BANNER", "1")
    config = mesh_config(engines=1)
    config["node_agents"] = []
    coordinator = build(parse_mesh_config(config, "mesh.yaml"))
    await coordinator.app.start()
    try:
        async with grpc.aio.insecure_channel(config["coordinator"]["listen"]) as ch:
            registry, admin = registry_pb2_grpc.RegistryStub(ch), admin_pb2_grpc.AdminStub(ch)
            await registry.Register(registry_pb2.RegisterRequest(instance=instance()))
            ledger = coordinator.picker.ledger

            def beat(prompt: int, generation: int) -> registry_pb2.HeartbeatRequest:
                progress = common_pb2.RankProgress(
                    dp_rank=0, prompt_tokens_total=prompt, generation_tokens_total=generation
                )
                load = common_pb2.InstanceLoad(progress=[progress])
                return registry_pb2.HeartbeatRequest(
                    instance_id="i0", health=common_pb2.HEALTH_HEALTHY, load=load
                )

            call = registry.Heartbeat()  # one beat at a time: the commit falls between the two
            await applied(call, beat(5000, 700))  # baseline
            ledger.commit("i0", 300, 20, 420, prompt_tokens=400)  # a request routed meanwhile
            await applied(call, beat(5400, 701))  # its first token: prompt counted
            await call.done_writing()
            (stats,) = (await admin.GetStats(admin_pb2.GetStatsRequest())).instances
            assert (stats.prefill_tokens, stats.inflight_requests) == (0, 1)
            assert stats.decode_tokens == 19
    finally:
        await coordinator.app.server.stop(0)


async def test_busy_heartbeats_teach_the_latency_model_and_metrics_show_it(monkeypatch):
    monkeypatch.setenv("TANDEM_NO_BANNER", "1")
    config = mesh_config(engines=1)
    config["node_agents"] = []
    coordinator = build(parse_mesh_config(config, "mesh.yaml"))
    now = [0.0]
    ledger = coordinator.picker.ledger
    ledger.clock = lambda: now[0]
    book = coordinator.picker.latency
    await coordinator.app.start()
    try:
        async with grpc.aio.insecure_channel(config["coordinator"]["listen"]) as ch:
            registry = registry_pb2_grpc.RegistryStub(ch)
            await registry.Register(registry_pb2.RegisterRequest(instance=instance()))

            def beat(prompt: int, generation: int, running: int) -> registry_pb2.HeartbeatRequest:
                progress = common_pb2.RankProgress(
                    dp_rank=0, prompt_tokens_total=prompt, generation_tokens_total=generation
                )
                load = common_pb2.InstanceLoad(running_requests=running, progress=[progress])
                return registry_pb2.HeartbeatRequest(
                    instance_id="i0", health=common_pb2.HEALTH_HEALTHY, load=load
                )

            call = registry.Heartbeat()  # one beat at a time (a generator ran ahead: it failed now and then)
            await applied(call, beat(0, 0, 1))  # baseline
            for k in range(1, 13):  # 3 s busy: each quarter second one 1,000-token prefill done
                ledger.commit("i0", 1000, 1, 1001, prompt_tokens=1000)
                now[0] = k * 0.25
                await applied(call, beat(1000 * k, k, 1))
            await call.done_writing()
        assert book.observed("i0") == 1  # one window of 2 s
        assert book.costs("i0").prefill > book.prior.prefill  # 4,000 tokens/s: slower than the prior's 10,000
        text = prometheus_client.generate_latest().decode()
        assert 'tandem_coordinator_step_cost_seconds{instance="i0",term="prefill"}' in text
    finally:
        await coordinator.app.server.stop(0)


async def test_heartbeats_feed_the_pd_sizing_signal_on_getstats_and_metrics(monkeypatch):
    monkeypatch.setenv("TANDEM_NO_BANNER", "1")
    config = mesh_config(engines=1)
    config["node_agents"] = []
    config["coordinator"]["probe_instances"] = False
    config["coordinator"]["sizing"] = {"window_s": 10}
    coordinator = build(parse_mesh_config(config, "mesh.yaml"))
    now = [0.0]
    ledger = coordinator.picker.ledger
    ledger.clock = lambda: now[0]
    coordinator.registry.demand.clock = lambda: now[0]
    await coordinator.app.start()
    try:
        async with grpc.aio.insecure_channel(config["coordinator"]["listen"]) as ch:
            registry, admin = registry_pb2_grpc.RegistryStub(ch), admin_pb2_grpc.AdminStub(ch)
            handoff = common_pb2.DISPATCH_CAPABILITY_HANDOFF
            for iid, role in (("p0", common_pb2.ROLE_PREFILL), ("d0", common_pb2.ROLE_DECODE)):
                await registry.Register(
                    registry_pb2.RegisterRequest(
                        instance=instance(instance_id=iid, role=role, dispatch_capability=handoff)
                    )
                )
            (idle,) = (await admin.GetStats(admin_pb2.GetStatsRequest())).sizing
            assert (idle.prefill_utilisation, idle.decode_utilisation) == (0, 0)
            assert (idle.suggested_prefill_instances, idle.suggested_decode_instances) == (1, 1)

            def beat(iid: str, prompt: int, generation: int) -> registry_pb2.HeartbeatRequest:
                progress = common_pb2.RankProgress(
                    dp_rank=0, prompt_tokens_total=prompt, generation_tokens_total=generation
                )
                load = common_pb2.InstanceLoad(running_requests=1, progress=[progress])
                return registry_pb2.HeartbeatRequest(
                    instance_id=iid, health=common_pb2.HEALTH_HEALTHY, load=load
                )

            call = registry.Heartbeat()  # one beat at a time: each is applied before the clock moves
            await applied(call, beat("p0", 0, 0))  # baselines
            await applied(call, beat("d0", 0, 0))
            for k in range(1, 11):  # 10 s: a 2,000-token prefill done each second on p0
                ledger.commit("p0", 2000, 0, 2000, prompt_tokens=2000)
                now[0] = float(k)
                await applied(call, beat("p0", 2000 * k, k))
            await call.done_writing()
        async with grpc.aio.insecure_channel(config["coordinator"]["listen"]) as ch:
            (z,) = (await admin_pb2_grpc.AdminStub(ch).GetStats(admin_pb2.GetStatsRequest())).sizing
        assert z.model == "tandem-sim" and not z.aggregated
        assert z.prefill_tokens_per_s == pytest.approx(2000)  # 20,000 tokens over the 10 s window
        # over the capacity the busy seconds taught (2,000 tokens took a second: slower than the prior's 9,831/s)
        learned = prefill_capacity(coordinator.picker.latency.costs("p0"), Limits())
        assert learned < 8192 / (0.014 + 0.8192)
        assert z.prefill_utilisation == pytest.approx(2000 / learned)
        assert z.decode_utilisation == 0
        assert (z.prefill_instances, z.decode_instances) == (1, 1)
        text = prometheus_client.generate_latest().decode()
        assert (
            f'tandem_coordinator_pd_utilisation{{model="tandem-sim",role="prefill"}} {z.prefill_utilisation!r}'
            in text
        )
        assert 'tandem_coordinator_pd_utilisation{model="tandem-sim",role="decode"} 0.0' in text
        assert 'tandem_coordinator_pd_suggested_instances{model="tandem-sim",role="prefill"} 1.0' in text
    finally:
        await coordinator.app.server.stop(0)


async def test_list_decisions_answers_the_operator_only_with_each_candidates_scores(monkeypatch, tmp_path):
    """`Admin/ListDecisions` over mutual TLS: the operator's certificate reads the decisions, newest first, with
    the chosen instance and every candidate's score components; a node agent's is refused, naming the method."""
    monkeypatch.setenv("TANDEM_NO_BANNER", "1")
    config = mesh_config(engines=2, policy="kv_affinity")
    config["coordinator"]["probe_instances"] = False
    mesh = parse_mesh_config(config, "mesh.yaml")
    ensure_certs(tmp_path, mesh)
    coordinator = build(mesh, tls.TlsFiles.for_role(tmp_path, "coordinator"))
    picker = coordinator.picker
    for i in range(2):
        picker.instances.register(
            InstanceInfo(f"e{i}", "tandem-sim", f"127.0.0.1:{i + 1}", "hybrid", "aggregated")
        )
    body = json.dumps({"model": "tandem-sim", "prompt": "the same words " * 30, "max_tokens": 8}).encode()
    for k in range(3):
        await picker.decide("completions", body, f"tdm-{k}")
    address = config["coordinator"]["listen"]
    await coordinator.app.start()
    try:
        async with tls.aio_channel(address, tls.TlsFiles.for_role(tmp_path, "operator"), "coordinator") as ch:
            reply = await admin_pb2_grpc.AdminStub(ch).ListDecisions(
                admin_pb2.ListDecisionsRequest(limit=2), timeout=5
            )
        assert [d.request_id for d in reply.decisions] == ["tdm-2", "tdm-1"]
        assert (reply.capacity, reply.recorded_total) == (256, 3)
        newest = reply.decisions[0]
        assert (newest.model, newest.policy, newest.stage) == ("tandem-sim", "kv_affinity", "aggregated")
        assert newest.prompt_tokens > 0 and newest.decided_at.seconds > 0
        assert sorted(c.instance_id for c in newest.candidates) == ["e0", "e1"]
        (chosen,) = [c for c in newest.candidates if c.chosen]
        assert list(newest.chosen) == [chosen.instance_id]
        assert (
            chosen.predicted_ttft_seconds > 0 and chosen.inflight >= 1
        )  # the earlier requests, still in flight
        async with tls.aio_channel(address, tls.TlsFiles.for_role(tmp_path, "agent/n1"), "coordinator") as ch:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await admin_pb2_grpc.AdminStub(ch).ListDecisions(admin_pb2.ListDecisionsRequest(), timeout=5)
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "Admin/ListDecisions" in info.value.details() and "agent/n1" in info.value.details()
    finally:
        await coordinator.app.server.stop(0)

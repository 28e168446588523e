"""What a compromised node's agent certificate can still register (`coordinator.admission`, the Registry's probe,
cap, hosts, mesh-file ownership and removal of silent entries): the pure rules, then the Registry service called
as an agent of a given node, without a server."""

from __future__ import annotations

import contextlib
import dataclasses

import grpc
import pytest
from aiohttp import web

from coordinator.admission import NodeBook, registration_refusal
from coordinator.config import CoordinatorConfig
from coordinator.instance_probe import HealthProber
from coordinator.instances import Health, InstanceInfo, InstanceTable
from coordinator.services import RegistryService
from coordinator.shared_state import LocalState
from mesh.config import parse_mesh_config
from tandem.tls import caller_var
from tandem.v1 import common_pb2, registry_pb2
from tests.helpers import eventually, mesh_config

BOOK = NodeBook(
    owners={"a-0": frozenset({"n1"}), "b-0": frozenset({"n2"})},
    hosts={"n1": frozenset({"10.0.0.1", "127.0.0.1"}), "n2": frozenset({"10.0.0.2"})},
    envoy_addresses=("127.0.0.1:8000", "0.0.0.0:9002"),
)


def info(iid: str = "x-0", address: str = "10.0.0.1:8100", node: str = "n1") -> InstanceInfo:
    return InstanceInfo(iid, "m", address, "hybrid", "aggregated", node_id=node)


def refusal(node, i, owner=None, count=0, cap=8):
    found = registration_refusal(BOOK, node, i, owner, count, cap)
    return None if found is None else (found.code, found.message)


# -- the pure rules -----------------------------------------------------------------------------------------------


def test_a_node_registers_its_own_ids_at_its_own_hosts_up_to_the_cap():
    assert refusal("n1", info("a-0")) is None
    assert refusal("n1", info("unnamed-0")) is None  # ids the file does not name: first come
    assert refusal("n1", info("a-0", "localhost:8100")) is None  # loopback names are one host
    code, message = refusal("n1", info("a-0"), count=8)
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_instances_per_node is 8" in message


def test_ids_the_mesh_file_gives_another_node_are_refused_even_when_free():
    code, message = refusal("n2", info("a-0", "10.0.0.2:8100", "n2"))
    assert code == grpc.StatusCode.PERMISSION_DENIED and "gives instance 'a-0' to node n1" in message
    code, message = refusal("n2", info("unnamed-0", "10.0.0.2:1", "n2"), owner="n1")
    assert code == grpc.StatusCode.PERMISSION_DENIED and "registered by the agent of node 'n1'" in message


def test_hosts_outside_the_node_and_unknown_nodes_are_refused():
    code, message = refusal("n1", info("a-0", "10.0.0.2:8100"))
    assert code == grpc.StatusCode.PERMISSION_DENIED and "not a host of node 'n1'" in message
    code, message = refusal("n9", info("z-0", "10.0.0.9:1", "n9"))
    assert code == grpc.StatusCode.PERMISSION_DENIED and "not in the mesh file" in message


@pytest.mark.parametrize("address", ["127.0.0.1:8000", "localhost:8000", "10.0.0.1:9002", "[::1]:8000"])
def test_envoys_own_listeners_are_refused_in_every_mode(address):
    for node in ("n1", None):  # with and without identities (insecure mode)
        code, message = refusal(node, info("a-0", address))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "Envoy's own listener" in message


def test_the_mesh_file_gives_ids_and_hosts_to_nodes():
    config = mesh_config(engines=2)
    agent = config["node_agents"][0]
    agent["hosts"] = ["10.1.1.1"]
    agent["engines"][1].update(
        instance_id="dp", data_parallel_size=4, data_parallel_size_local=2, data_parallel_start_rank=2,
        kv_events_port=5557,
    )  # fmt: skip
    book = parse_mesh_config(config).node_book
    assert {k: sorted(v) for k, v in book.owners.items()} == {
        "sim-0": ["n1"], "dp": ["n1"], "dp-dp2": ["n1"], "dp-dp3": ["n1"],
    }  # fmt: skip
    assert book.hosts["n1"] == frozenset({"127.0.0.1", "10.1.1.1"})
    assert config["envoy"]["http_listen"] in book.envoy_addresses


# -- the Registry as an agent sees it -----------------------------------------------------------------------------


class Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code, self.details = code, details


class Context:
    async def abort(self, code, details):
        raise Aborted(code, details)


def message(iid: str, address: str, node: str = "n1") -> registry_pb2.RegisterRequest:
    return registry_pb2.RegisterRequest(
        instance=common_pb2.Instance(
            instance_id=iid,
            model="m",
            address=address,
            role=common_pb2.ROLE_HYBRID,
            dispatch_capability=common_pb2.DISPATCH_CAPABILITY_AGGREGATED,
            node_id=node,
        )
    )


async def register(service: RegistryService, node: str, iid: str, address: str) -> grpc.StatusCode:
    caller_var.set(f"agent/{node}")
    try:
        await service.Register(message(iid, address, node), Context())
    except Aborted as exc:
        return exc.code
    return grpc.StatusCode.OK


@contextlib.asynccontextmanager
async def health_server():
    """An engine's /health on a free loopback port."""

    async def health(_):
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_get("/health", health)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # noqa: SLF001 - aiohttp exposes the bound port only here
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await runner.cleanup()


def registry(cap: int = 8, probe: bool = True) -> RegistryService:
    book = NodeBook(
        owners={"sim-0": frozenset({"n1"})},
        hosts={"n1": frozenset({"127.0.0.1"}), "n2": frozenset({"127.0.0.1"})},
        envoy_addresses=("127.0.0.1:8000",),
    )
    config = CoordinatorConfig(max_instances_per_node=cap)
    prober = HealthProber(timeout_s=0.5, interval_s=0.05) if probe else None
    return RegistryService(InstanceTable(["m"]), config, tls_on=True, book=book, prober=prober)


async def test_a_flood_of_dead_instances_is_never_routable_and_stops_at_the_cap():
    """The issue's flood: registrations at an address where nothing answers (a port nobody listens on). None is
    routable (the probe never passes), and past the cap every registration is refused; the real engine, once it
    answers its probe, is the only routable one."""
    service = registry(cap=8)
    try:
        async with health_server() as engine:
            assert await register(service, "n1", "sim-0", engine) == grpc.StatusCode.OK
            codes = [await register(service, "n1", f"fake-{i}", "127.0.0.1:9") for i in range(50)]
            assert codes.count(grpc.StatusCode.OK) == 7  # the cap counts the real engine too
            assert set(codes[7:]) == {grpc.StatusCode.RESOURCE_EXHAUSTED}
            await eventually(lambda: service.instances.get("sim-0").routable, 5, "the engine answered")
            assert [s.info.instance_id for s in service.instances.all() if s.routable] == ["sim-0"]
            # Another node's cap is its own.
            assert await register(service, "n2", "other-0", "127.0.0.1:9") == grpc.StatusCode.OK
    finally:
        await service.close()


async def test_re_registering_the_same_engine_keeps_it_routable():
    service = registry()
    try:
        async with health_server() as engine:
            await register(service, "n1", "sim-0", engine)
            await eventually(lambda: service.instances.get("sim-0").routable, 5, "probed")
            await register(service, "n1", "sim-0", engine)  # the agent restarted
            assert service.instances.get("sim-0").routable
            await register(service, "n1", "sim-0", "127.0.0.1:9")  # a new address is probed again
            assert not service.instances.get("sim-0").routable
    finally:
        await service.close()


async def test_an_entry_replaced_by_another_replicas_registration_is_probed_until_it_answers():
    """With replicas, another replica's registration of the same instance arrives from etcd and replaces this
    replica's table entry while its probe runs (the chaos test's 'kill an engine' saw one replica keep a restarted
    engine unverified for good): the probe follows the entry in the table."""
    service = registry()
    try:
        await register(service, "n1", "sim-0", "127.0.0.1:9")  # nothing answers yet: probing
        async with health_server() as engine:
            info = dataclasses.replace(service.instances.get("sim-0").info, address=engine)
            service.instances.register(info, verified=False)  # as `shared_state.apply_change` does
            await eventually(lambda: service.instances.get("sim-0").routable, 5, "the replaced entry probed")
    finally:
        await service.close()


class OwnRecords(LocalState):
    """What this replica writes to etcd for the instances its agents report to it: `verified` per instance."""

    def __init__(self) -> None:
        self.verified_by_id: dict[str, bool] = {}

    def registered(self, info: InstanceInfo, verified: bool = True) -> None:
        self.verified_by_id[info.instance_id] = verified

    def verified(self, instance_id: str) -> None:
        self.verified_by_id[instance_id] = True


async def test_a_probe_that_passes_after_another_replica_verified_the_entry_still_writes_its_own_record():
    """At start an agent registers an engine with both replicas. The other replica's probe passes first and its
    record (applied from etcd) marks this replica's entry verified; this replica's own record still says `verified:
    false` from its registration and, rewritten with every heartbeat it relays, turned the engine unroutable again
    on every replica (CI: `tandem up` never saw the engine healthy). Its probe must correct its own record."""
    own = OwnRecords()
    service = registry()
    service.shared = own
    try:
        async with health_server() as engine:
            await register(service, "n1", "sim-0", engine)
            assert own.verified_by_id == {"sim-0": False}
            # Another replica's record, as `apply_change` applies it.
            service.instances.get("sim-0").verified = True
            await eventually(lambda: not service._probes, 5, "the probe passed")  # noqa: SLF001
            assert own.verified_by_id == {"sim-0": True}
    finally:
        await service.close()


async def test_a_re_registered_engine_that_no_longer_answers_turns_unroutable_at_once():
    """A whole node restarted: its new agent re-registers an engine it is still relaunching. The engine stays
    routable on its old probe only until one probe finds nothing there; it is routable again once it answers."""
    service = registry()
    try:
        async with health_server() as engine:
            await register(service, "n1", "sim-0", engine)
            await eventually(lambda: service.instances.get("sim-0").routable, 5, "probed")
        await register(service, "n1", "sim-0", engine)  # the server above is gone
        await eventually(lambda: not service.instances.get("sim-0").routable, 2, "found dead by its probe")
        assert service._probes  # noqa: SLF001 - probing on until it answers
    finally:
        await service.close()


async def test_squatting_after_a_restart_is_refused_and_the_owner_keeps_its_id():
    """The issue's squatting: a coordinator restarted (an empty table) and another node's agent registers the id
    first. The mesh file names the owner, so the squatter is refused and the owner registers."""
    service = registry(probe=False)  # a fresh coordinator: nothing registered
    assert await register(service, "n2", "sim-0", "127.0.0.1:7") == grpc.StatusCode.PERMISSION_DENIED
    assert service.instances.get("sim-0") is None
    assert await register(service, "n1", "sim-0", "127.0.0.1:7") == grpc.StatusCode.OK
    assert service.instances.get("sim-0").info.node_id == "n1"


async def test_an_id_the_file_does_not_name_is_released_when_its_entry_stays_silent():
    service = registry(probe=False)
    assert await register(service, "n2", "free-0", "127.0.0.1:7") == grpc.StatusCode.OK
    assert await register(service, "n1", "free-0", "127.0.0.1:7") == grpc.StatusCode.PERMISSION_DENIED
    service.instances.get("free-0").last_heartbeat_at -= 100  # its agent went silent
    assert service.remove_silent(60) == ["free-0"]
    assert await register(service, "n1", "free-0", "127.0.0.1:7") == grpc.StatusCode.OK


async def test_envoys_address_is_refused_with_a_clear_status():
    service = registry(probe=False)
    caller_var.set("agent/n1")
    with pytest.raises(Aborted) as refused:
        await service.Register(message("sim-0", "127.0.0.1:8000"), Context())
    assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "Envoy's own listener" in refused.value.details and service.instances.all() == []


async def test_a_probe_ends_when_its_instance_leaves():
    service = registry()
    await register(service, "n1", "sim-0", "127.0.0.1:9")
    assert service._probes  # noqa: SLF001 - the loop in flight
    service.remove("sim-0")
    await eventually(lambda: not service._probes, 2, "the probe loop ended")  # noqa: SLF001
    await service.close()


async def test_a_probed_instance_turning_routable_wakes_the_decisions_waiting_for_one():
    """The relearn window's wake-up comes at registration and again when the probe passes: a decision woken by the
    registration alone found the instance not yet routable and, without the second wake, waited until the window
    closed and answered 503 (seen under `tandem up` once agents registered within 0.1 s of a restart)."""
    service = registry()
    wakes: list[bool] = []
    service.on_registered = lambda: wakes.append(service.instances.get("sim-0").routable)
    try:
        async with health_server() as engine:
            await register(service, "n1", "sim-0", engine)
            await eventually(lambda: len(wakes) == 2, 5, "the second wake, at the probe's answer")
            assert wakes == [False, True]  # registered (not routable yet), then routable
    finally:
        await service.close()


async def test_when_an_agents_stream_ends_its_dead_engines_turn_unhealthy_at_once_and_live_ones_stay():
    """A whole node died (agent and engines): its engines are probed as soon as the agent's heartbeat stream ends,
    not after the silence TTL, and the one that does not answer is unroutable within the probe's deadline. An
    engine that still answers (only its agent died) keeps serving."""
    service = registry()
    try:
        async with health_server() as engine:
            await register(service, "n1", "live-0", engine)
            await register(service, "n1", "dead-0", "127.0.0.1:9")
            beats = [
                registry_pb2.HeartbeatRequest(instance_id=iid, health=common_pb2.HEALTH_HEALTHY)
                for iid in ("live-0", "dead-0")
            ]

            async def stream():
                for beat in beats:
                    yield beat

            assert [r.known async for r in service.Heartbeat(stream(), Context())] == [True, True]
            assert (
                service.instances.get("dead-0").health is Health.HEALTHY
            )  # the agent's word, until the stream ends
            await eventually(
                lambda: service.instances.get("dead-0").health is Health.UNHEALTHY, 2, "dead-0 out"
            )
            await eventually(lambda: not service._orphan_checks, 2, "the check ended")  # noqa: SLF001
            assert service.instances.get("live-0").health is Health.HEALTHY
    finally:
        await service.close()

"""Replicas' shared state: the pure apply rules, and the etcd implementation against a real etcd (Debian's
`etcd-server`; skipped where it is not installed)."""

from __future__ import annotations

import time

import pytest

from coordinator.instances import Health, InstanceInfo, InstanceTable
from coordinator.shared_state import (
    DrainSet,
    InstanceGone,
    InstancePut,
    apply_change,
    decode_instance,
    encode_instance,
)
from tandem.engine_load import EngineLoad
from tests.helpers import Etcd, eventually

INFO = InstanceInfo("e1", "m", "127.0.0.1:7001", "hybrid", "aggregated", node_id="n1")


def test_apply_is_idempotent_and_keeps_drain_flags():
    table, drained = InstanceTable(), set()
    apply_change(table, DrainSet("e1", True), drained)  # drained before it registered here
    put = InstancePut(INFO, Health.HEALTHY, EngineLoad(running=2))
    apply_change(table, put, drained)
    apply_change(table, put, drained)  # a replica sees its own write again
    state = table.get("e1")
    assert state is not None and state.drained and state.load.running == 2 and len(table.all()) == 1
    apply_change(table, InstancePut(INFO, Health.UNHEALTHY, EngineLoad()), drained)
    assert table.get("e1") is state and state.health is Health.UNHEALTHY  # same entry, reported health
    apply_change(table, DrainSet("e1", False), drained)
    assert not state.drained
    apply_change(table, InstanceGone("e1"), drained)
    assert table.get("e1") is None


def test_instance_record_round_trip():
    put = InstancePut(INFO, Health.HEALTHY, EngineLoad(running=1, waiting=2, kv_cache_usage=0.5))
    assert decode_instance(encode_instance(put)) == put
    lora = EngineLoad(adapters=frozenset({"b", "a"}), active_adapters=frozenset({"a"}), max_loras=4)
    assert decode_instance(encode_instance(InstancePut(INFO, Health.HEALTHY, lora))).load == lora
    # Per-rank maps keep their int ranks (JSON makes them strings; Admin's ListInstances needs ints).
    ranks = EngineLoad(progress={0: (10, 2), 3: (5, 1)}, prefix_hits={0: 7, 3: 1})
    assert decode_instance(encode_instance(InstancePut(INFO, Health.HEALTHY, ranks))).load == ranks
    with pytest.raises(ValueError):
        decode_instance(b'{"x": 1}')


async def replicas(etcd: Etcd, ttl_s: float = 1.0, count: int = 2):
    from coordinator.etcd_state import EtcdState

    states = []
    for _ in range(count):
        state = EtcdState(etcd.endpoint, "/t", ttl_s)
        await state.start(InstanceTable())
        states.append(state)
    return states


async def test_every_replica_sees_registrations_health_drains_within_a_second(etcd):
    a, b = await replicas(etcd, ttl_s=5)
    try:
        a.table.register(INFO)
        a.registered(INFO)
        await eventually(lambda: b.table.get("e1") is not None, 1.0, "registration seen by the other replica")
        a.reported("e1", Health.UNHEALTHY, EngineLoad(running=3))
        await eventually(lambda: b.table.get("e1").health is Health.UNHEALTHY, 1.0, "health seen")
        assert b.table.get("e1").load.running == 3
        b.drain_set("e1", True)  # an operator drains through the other replica
        await eventually(lambda: a.table.get("e1").drained, 1.0, "drain seen")
        a.deregistered("e1")
        await eventually(lambda: b.table.get("e1") is None, 1.0, "deregistration seen")
    finally:
        await a.close()
        await b.close()


async def test_an_instance_nobody_reports_on_ends_with_its_lease(etcd):
    a, b = await replicas(etcd, ttl_s=1)
    try:
        a.registered(INFO)
        await eventually(lambda: b.table.get("e1") is not None, 2.0, "registration seen")
        await a.close()  # the replica the agent reported to is gone; nobody keeps the lease alive
        # etcd ends a 1 s lease after 1.5 s at the earliest (its minimum TTL) and checks every 0.5 s: about 2.2 s on
        # an idle machine; the revocation is a raft commit (an fsync), which a loaded machine can delay by seconds.
        await eventually(lambda: b.table.get("e1") is None, 15.0, "lease ended")
    finally:
        await b.close()


async def test_last_known_state_while_etcd_is_down_then_catch_up(etcd):
    a, b = await replicas(etcd, ttl_s=1)
    try:
        a.registered(INFO)
        await eventually(lambda: b.table.get("e1") is not None, 2.0, "registration seen")
        etcd.stop()
        await eventually(lambda: not b.connected, 5.0, "outage noticed")
        lease_over = time.time() + a.ttl  # e1's lease was last refreshed before the outage
        late = InstanceInfo("e2", "m", "127.0.0.1:7002", "hybrid", "aggregated")
        a.registered(late)  # registered during the outage
        a.reported("e1", Health.HEALTHY, EngineLoad())

        def kept_past_its_lease() -> bool:  # B keeps serving what it knew, refreshing it itself
            state = b.table.get("e1")
            assert state is not None and state.health is Health.HEALTHY
            return state.last_heartbeat_at > lease_over

        await eventually(kept_past_its_lease, 10.0, "B keeping e1 past the end of its lease")
        etcd.start()  # same data directory: the old leases have ended meanwhile
        await eventually(lambda: b.connected and b.table.get("e2") is not None, 10.0, "caught up")
        assert b.table.get("e1") is not None
    finally:
        await a.close()
        await b.close()


async def test_a_scheduler_reloaded_by_one_replica_reaches_the_others(etcd):
    a, b = await replicas(etcd)
    seen: list[dict] = []
    b.on_scheduler = seen.append
    try:
        await eventually(lambda: a.connected and b.connected, 5.0, "connected")
        a.scheduler_set({"policy": "round_robin"})
        await eventually(
            lambda: seen == [{"policy": "round_robin"}], 1.0, "section seen by the other replica"
        )
        a.scheduler_set({"policy": "round_robin"})  # unchanged: not written again
        late = (await replicas(etcd, count=1))[0]  # a replica starting later takes the mesh's section
        try:
            await eventually(lambda: late.connected, 5.0, "late replica connected")
            assert late.scheduler_seen == {"policy": "round_robin"}
        finally:
            await late.close()
    finally:
        await a.close()
        await b.close()


def test_shared_scheduler_applies_valid_sections_only():
    from types import SimpleNamespace

    from coordinator.app import apply_shared_scheduler
    from mesh.config import parse_mesh_config
    from tests.helpers import make_picker

    mesh = parse_mesh_config({}, "mesh.yaml")
    picker, matcher = make_picker(), SimpleNamespace(timeout_s=0.0)
    assert apply_shared_scheduler(mesh, picker, matcher, {"policy": "round_robin", "match_timeout_ms": 40})
    assert mesh.coordinator.scheduler.policy == "round_robin" and picker.policy.name == "round_robin"
    assert matcher.timeout_s == 0.04
    assert not apply_shared_scheduler(mesh, picker, matcher, {"policy": "no-such-policy"})
    assert not apply_shared_scheduler(
        mesh, picker, matcher, {"policy": "round_robin", "match_timeout_ms": 40}
    )
    assert mesh.coordinator.scheduler.policy == "round_robin"
    assert apply_shared_scheduler(mesh, picker, matcher, {"policy": "round_robin", "decode_policy": "llm_d"})
    assert picker.decode_policy.name == "llm_d" and picker.policy.name == "round_robin"

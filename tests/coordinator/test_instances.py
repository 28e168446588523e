"""The instance table's silence rules: an agent's silence alone does not expire engines that still answer."""

from __future__ import annotations

import asyncio

from coordinator.app import expire_silent
from coordinator.instances import Health, InstanceInfo, InstanceTable
from tests.helpers import eventually, make_picker


def info(iid: str) -> InstanceInfo:
    return InstanceInfo(iid, "m", f"127.0.0.1:{1000 + int(iid[-1])}", "hybrid", "aggregated", node_id="n1")


def test_silent_agent_engines_are_asked_first_and_kept_while_they_answer():
    table = InstanceTable()
    for iid in ("e1", "e2"):
        table.register(info(iid)).last_heartbeat_at = 100.0
    # Half the lease without a heartbeat: both are to be asked; none expired yet.
    assert table.to_vouch(10, now=104) == [] and {
        s.info.instance_id for s in table.to_vouch(10, now=106)
    } == {
        "e1",
        "e2",
    }
    assert table.vouch("e1", now=106) and not table.vouch("gone", now=106)
    # Past the lease: the one that answered keeps its health, the silent one does not.
    assert table.expire(10, now=111) == ["e2"]
    assert table.get("e1").health is Health.HEALTHY and table.get("e2").health is Health.UNHEALTHY
    assert [s.info.instance_id for s in table.to_vouch(10, now=112)] == ["e1"]  # asked again later
    assert table.expire(10, now=117) == ["e1"]  # no answer since 106: expired like before
    # A heartbeat makes it the agent's again (an unhealthy report stays unhealthy: vouching keeps, never heals).
    table.heartbeat("e2", Health.HEALTHY, table.get("e2").load, now=118)
    assert table.get("e2").health is Health.HEALTHY and table.to_vouch(10, now=120) == []


async def test_expire_silent_probes_the_engines_of_a_silent_agent():
    """Bounded: a 0.4 s lease, at most 5 s. On main the answering engine was expired with the silent one."""
    picker = make_picker(instances=0)
    for iid in ("e1", "e2"):
        picker.instances.register(info(iid))
    asked: list[str] = []

    async def probe(address: str) -> bool:
        asked.append(address)
        return address.endswith(":1001")  # e1 answers, e2 is dead

    task = asyncio.create_task(expire_silent(picker, 0.4, probe=probe))
    try:
        await eventually(
            lambda: picker.instances.get("e2").health is Health.UNHEALTHY, 5, "silent engine expired"
        )
        loop = asyncio.get_running_loop()
        since = loop.time()
        await eventually(lambda: loop.time() - since > 1.2, 5, "three leases more")
        assert picker.instances.get("e1").health is Health.HEALTHY
        assert asked.count("127.0.0.1:1001") >= 3  # asked again each half lease
    finally:
        task.cancel()

"""Engines outlive their agent: the node agent killed under steady streaming load, its engines keep serving, the
agent `tandem up` starts again adopts them (same pids), re-registers them and resumes relaying their KV events."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from bench.steady_load import SteadyLoad
from tandem.v1 import admin_pb2, node_agent_pb2
from tests.helpers import RunningMesh, mesh_config, metric_sum, processes_mentioning


@pytest.fixture
def mesh(tmp_path):
    config = mesh_config(engines=2, engine_args=["--speedup", "10"])
    # The instances' lease outlasts an agent restart (the default is three heartbeat intervals).
    config["coordinator"]["instance_ttl_s"] = 30
    config["up"] = {"restart": {"initial_backoff_s": 0.2}}
    running = RunningMesh(config, tmp_path)
    running.start()
    yield running
    if running.process.poll() is None:
        running.stop()


def status(mesh: RunningMesh) -> dict:
    return json.loads((mesh.run_dir / "status.json").read_text())


def test_killed_agent_engines_keep_serving_and_are_adopted(mesh):
    before = mesh.engines()
    pids = {iid: e.pid for iid, e in before.items()}
    assert all(pids.values()) and not any(e.adopted for e in before.values())
    agent_pid = status(mesh)["agent-n1"]["pid"]
    load = SteadyLoad(mesh.http, "tandem-sim", clients=4).start()
    try:
        mesh.wait_for(lambda: load.count(ok=True) >= 8, 60, "load flowing")
        os.kill(agent_pid, signal.SIGKILL)
        mesh.wait_for(lambda: status(mesh)["agent-n1"]["restarts"] == 1, 30, "agent restarted by tandem up")

        def adopted() -> bool:
            try:
                engines = mesh.engines()
            except Exception:
                return False
            return all(
                e.adopted and e.state == node_agent_pb2.ENGINE_STATE_RUNNING and e.pid == pids[iid]
                for iid, e in engines.items()
            )

        mesh.wait_for(adopted, 60, "engines adopted by the new agent")
        served = load.count(ok=True)
        mesh.wait_for(lambda: load.count(ok=True) >= served + 8, 60, "load served after the adoption")
    finally:
        load.stop()
    report = load.report()
    print(f"agent killed under load: {report}")
    assert report.failed == 0, report.errors[:5]
    after = mesh.engines()
    assert {iid: e.pid for iid, e in after.items()} == pids and all(e.restarts == 0 for e in after.values())
    listed = mesh.admin().ListInstances(admin_pb2.ListInstancesRequest(), timeout=5).instances
    assert sorted(i.instance.instance_id for i in listed if i.health == 2) == ["sim-0", "sim-1"]
    # The new agent relays the engines' KV events again (its counters start at zero).
    agent_metrics = mesh.config["node_agents"][0]["metrics_listen"]
    mesh.wait_for(
        lambda: metric_sum(agent_metrics, "tandem_node_agent_kv_batches_relayed_total") > 0, 30, "relay"
    )
    mesh.wait_for(lambda: mesh.stats().requests_inflight == 0, 30, "workload back to zero")
    assert mesh.stats().workload_tokens == 0
    # Ctrl-C stops the engines too (they outlive an agent, not the mesh).
    assert mesh.stop() == 0
    left = [p for p in pids.values() if p in processes_mentioning("simengine")]
    assert left == [], left


FREEZE_S = 5.0  # past three leases of the default 1.5 s (three heartbeat intervals of 0.5 s)


def test_frozen_agent_fails_no_request(tmp_path):
    """The agent SIGSTOPped for more than three instance leases, under streaming load: its engines still answer,
    so the coordinator (which asks them itself once the agent is silent) keeps them routable and no request fails.
    Bounded: 4 clients, a 5 s freeze, a minute at most. On main every engine of the node expired after 1.5 s and
    requests failed with 503 until the agent was continued."""
    config = mesh_config(
        engines=2, engine_args=["--speedup", "10"]
    )  # the default lease: 3 x 0.5 s heartbeats
    mesh = RunningMesh(config, tmp_path)
    mesh.start()
    try:
        agent_pid = status(mesh)["agent-n1"]["pid"]
        load = SteadyLoad(mesh.http, "tandem-sim", clients=4).start()
        try:
            mesh.wait_for(lambda: load.count(ok=True) >= 8, 60, "load flowing")
            frozen_at = time.monotonic()
            os.kill(agent_pid, signal.SIGSTOP)
            try:
                mesh.wait_for(lambda: time.monotonic() - frozen_at > FREEZE_S, 10, "frozen past three leases")
                listed = mesh.admin().ListInstances(admin_pb2.ListInstancesRequest(), timeout=5).instances
            finally:
                os.kill(agent_pid, signal.SIGCONT)
            served = load.count(ok=True)
            mesh.wait_for(lambda: load.count(ok=True) >= served + 8, 60, "load served after the thaw")
        finally:
            load.stop()
        report = load.report()
        during = load.report(frozen_at, frozen_at + FREEZE_S)
        print(f"agent frozen {FREEZE_S:g} s under load: {report}; during the freeze: {during}")
        assert sorted(i.instance.instance_id for i in listed if i.health == 2) == ["sim-0", "sim-1"]
        assert during.ok > 0
        assert report.failed == 0, report.errors[:5]
        mesh.wait_for(lambda: mesh.stats().requests_inflight == 0, 30, "workload back to zero")
    finally:
        mesh.stop()

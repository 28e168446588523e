"""Engines outlive their agent: the node agent killed under steady streaming load, its engines keep serving, the
agent `tandem up` starts again adopts them (same pids), re-registers them and resumes relaying their KV events."""

from __future__ import annotations

import json
import os
import signal

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

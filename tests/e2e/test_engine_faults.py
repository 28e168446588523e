"""Engine faults under steady streaming load: a killed engine and a hung one (SIGSTOP). The only requests that fail
are those already running on the faulty engine; new requests go to the others; the workload returns to zero."""

from __future__ import annotations

import os
import signal
import time

import pytest

from bench.steady_load import SteadyLoad
from tandem.v1 import admin_pb2, node_agent_pb2
from tests.helpers import RunningMesh, mesh_config


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    config = mesh_config(engines=3, engine_args=["--speedup", "10"])
    # Engines are the cluster's endpoints: a request refused before any byte is retried once on another engine.
    config["envoy"]["engines_cluster"] = "static"
    # The model's own idle timeout (the mesh default stays 120 s): a hung engine's requests end after 3 s without a byte.
    config["models"] = [{"name": "tandem-sim", "upstream_idle_timeout_s": 3}]
    running = RunningMesh(config, tmp_path_factory.mktemp("faults"))
    running.start()
    yield running
    if running.process.poll() is None:
        running.stop()


def healthy(mesh: RunningMesh) -> set[str]:
    listed = mesh.admin().ListInstances(admin_pb2.ListInstancesRequest(), timeout=5).instances
    return {i.instance.instance_id for i in listed if i.health == 2}


def settle(mesh: RunningMesh) -> None:
    mesh.wait_for(lambda: healthy(mesh) == {"sim-0", "sim-1", "sim-2"}, 60, "every engine healthy")
    mesh.wait_for(lambda: mesh.stats().requests_inflight == 0, 30, "workload back to zero")
    assert mesh.stats().workload_tokens == 0


def test_killed_engine_fails_only_its_own_streams(mesh):
    settle(mesh)
    victim = mesh.engines()["sim-1"]
    load = SteadyLoad(mesh.http, "tandem-sim", clients=6).start()
    try:
        mesh.wait_for(lambda: load.count(ok=True) >= 12, 60, "load flowing")
        killed_at = time.monotonic()
        os.kill(victim.pid, signal.SIGKILL)
        mesh.wait_for(lambda: mesh.engines()["sim-1"].pid not in (0, victim.pid), 30, "engine restarted")
        mesh.wait_for(lambda: "sim-1" in healthy(mesh), 30, "restarted engine registered")
        recovered_s = time.monotonic() - killed_at
        served = load.count(ok=True)
        mesh.wait_for(lambda: load.count(ok=True) >= served + 12, 60, "load served after the restart")
    finally:
        load.stop()
    report = load.report()
    failed = [o for o in load.outcomes if not o.ok]
    print(f"engine killed: {report}; restarted and registered in {recovered_s:.1f}s")
    # Only streams that were running on the killed engine may fail: each started before the kill.
    assert all(o.started < killed_at for o in failed), [o.error for o in failed]
    assert report.failed <= 6  # at most one stream per client was on it
    settle(mesh)


def test_hung_engine_is_ejected_and_its_requests_time_out(mesh):
    settle(mesh)
    victim = mesh.engines()["sim-2"]
    load = SteadyLoad(mesh.http, "tandem-sim", clients=6, timeout_s=30).start()
    try:
        mesh.wait_for(lambda: load.count(ok=True) >= 12, 60, "load flowing")
        stopped_at = time.monotonic()
        os.kill(victim.pid, signal.SIGSTOP)
        try:
            mesh.wait_for(lambda: "sim-2" not in healthy(mesh), 10, "hung engine ejected")
            ejected_s = time.monotonic() - stopped_at
            ejected_at = time.monotonic()
            served = load.count(ok=True)
            mesh.wait_for(lambda: load.count(ok=True) >= served + 12, 60, "load served by the others")
            # Hung past the idle timeout: its streams end with an error instead of waiting for it.
            mesh.wait_for(lambda: time.monotonic() - stopped_at > 4.5, 10, "idle timeout passed")
        finally:
            os.kill(victim.pid, signal.SIGCONT)
        mesh.wait_for(lambda: "sim-2" in healthy(mesh), 30, "engine healthy again")
    finally:
        load.stop()
    report = load.report()
    failed = [o for o in load.outcomes if not o.ok]
    print(
        f"engine hung (SIGSTOP) 4.5 s: {report}; ejected after {ejected_s:.2f}s; failed requests lasted "
        f"{[round(o.ended - o.started, 1) for o in failed]} s"
    )
    assert (
        ejected_s < 4.0
    )  # probe every 0.5 s, 1 s timeout, heartbeat at once: ~1.5 s (bound for a loaded CI box)
    # What failed was on the hung engine: started before the ejection, ended by the idle timeout (no hang).
    assert all(o.started < ejected_at for o in failed), [o.error for o in failed]
    assert all(o.ended - o.started < 10 for o in failed)  # the model's 3 s, not the mesh's 120 s
    assert mesh.engines()["sim-2"].state == node_agent_pb2.ENGINE_STATE_RUNNING
    settle(mesh)

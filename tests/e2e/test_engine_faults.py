"""Engine faults under steady streaming load: a killed engine and a hung one (SIGSTOP). The only requests that fail
are those already running on the faulty engine; new requests go to the others; the workload returns to zero."""

from __future__ import annotations

import contextlib
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
    # Engines are the cluster's endpoints: a request refused before any byte is retried once on another engine, and
    # Envoy health-checks every engine. The upstream idle timeout stays the default 120 s (long prefills are
    # legitimate): a frozen engine's requests must end by liveness, not by a request timeout.
    config["envoy"]["engines_cluster"] = "static"
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


FREEZE_S = (
    8.0  # past the 5 s the in-flight requests may take to end (issue 23: 12 s; shorter keeps the test short)
)


def test_frozen_engine_is_ejected_and_its_requests_end_within_seconds(mesh):
    """SIGSTOP an engine under streaming load: within 2 s nothing new goes to it, the agent reports it UNRESPONSIVE,
    and the requests on it end within 5 s (the agent's liveness timeout, 3 s without an answer, kills it: its
    connections close, a request not yet answered is retried elsewhere or gets an error, a stream is cut) instead of
    hanging until it thaws; the agent restarts it. Bounded: 6 clients,
    an 8 s freeze, a minute at most."""
    settle(mesh)
    victim = mesh.engines()["sim-2"]
    load = SteadyLoad(mesh.http, "tandem-sim", clients=6, timeout_s=30).start()
    try:
        mesh.wait_for(lambda: load.count(ok=True) >= 12, 60, "load flowing")
        stopped_at = time.monotonic()
        os.kill(victim.pid, signal.SIGSTOP)
        try:
            mesh.wait_for(lambda: "sim-2" not in healthy(mesh), 10, "frozen engine ejected")
            ejected_s = time.monotonic() - stopped_at
            ejected_at = time.monotonic()
            status = mesh.engines()["sim-2"]
            served = load.count(ok=True)
            mesh.wait_for(lambda: load.count(ok=True) >= served + 12, 60, "load served by the others")
            mesh.wait_for(lambda: time.monotonic() - stopped_at > FREEZE_S, 20, "frozen long enough")
            # Every request that was on it has ended by now, long before the thaw.
            in_flight_at_thaw = [t for t in load.running_since() if t < ejected_at]
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(victim.pid, signal.SIGCONT)
        mesh.wait_for(lambda: "sim-2" in healthy(mesh), 30, "engine healthy again (restarted)")
        assert mesh.engines()["sim-2"].state == node_agent_pb2.ENGINE_STATE_RUNNING
    finally:
        load.stop()
    report = load.report()
    failed = [o for o in load.outcomes if not o.ok]
    longest = max(o.ended - o.started for o in load.outcomes)
    print(
        f"engine frozen (SIGSTOP) {FREEZE_S:g} s: {report}; ejected after {ejected_s:.2f}s; failed requests ended "
        f"{[round(o.ended - stopped_at, 1) for o in failed]} s after the freeze; longest request {longest:.1f} s"
    )
    # Probe every 0.5 s, 1 s timeout, heartbeat at once: 1.5-2 s on a quiet box (the 2 s goal, measured by the chaos
    # bench); this bound leaves room for a CI box whose own test load delays the probe (2.50 s seen there).
    assert ejected_s < 3.0
    assert status.state == node_agent_pb2.ENGINE_STATE_UNRESPONSIVE, status
    assert "unresponsive" in status.detail
    assert in_flight_at_thaw == []
    # What failed was on the frozen engine (started before the ejection) and ended within 5 s of the freeze.
    assert all(o.started < ejected_at for o in failed), [o.error for o in failed]
    assert all(o.ended - stopped_at < 5.5 for o in failed), [round(o.ended - stopped_at, 1) for o in failed]
    assert longest < 7, longest  # nothing hung until the thaw (main: the frozen engine's streams took 8 s+)
    settle(mesh)

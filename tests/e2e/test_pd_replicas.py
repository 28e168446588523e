"""P/D handoff with two coordinator replicas behind Envoy: one is SIGKILLed while it runs prefill legs under steady
load, and Envoy opens each decision stream it was answering again on the other replica, which decides anew."""

from __future__ import annotations

import json
import os
import signal
import time

from bench.steady_load import SteadyLoad
from tandem.v1 import admin_pb2
from tests.e2e.test_coordinator_replicas import admin, healthy, replicas_seeing
from tests.helpers import RunningMesh, mesh_config


def envoy_counters(mesh: RunningMesh, pattern: str) -> dict[str, int]:
    """Envoy's counters and gauges whose name matches `pattern` (a regex, as /stats?filter= takes it)."""
    lines = mesh.envoy_admin(f"/stats?filter={pattern}").splitlines()
    return {name: int(value) for name, value in (line.split(": ", 1) for line in lines) if value.isdigit()}


def test_a_replica_killed_during_prefill_legs_fails_no_request(tmp_path, etcd):
    config = mesh_config(engines=3, engine_args=["--speedup", "20"], policy="kv_affinity")
    roles = [("prefill-0", "prefill"), ("prefill-1", "prefill"), ("decode-0", "decode")]
    for engine, (iid, role) in zip(config["node_agents"][0]["engines"], roles, strict=True):
        engine.update(instance_id=iid, role=role, kv_connector="NixlConnector")
        if role == "prefill":  # a prefill leg takes 0.3 s: most of a request's time is its undecided stream
            engine["args"] = [*engine["args"], "--fault-latency-ms", "300"]
    config["coordinator"].update(
        replicas=2,
        etcd={"endpoint": etcd.endpoint, "prefix": "/e2e"},
        instance_ttl_s=10,
        pd_mode="prefill_handoff_decode",
    )
    config["up"] = {"restart": {"initial_backoff_s": 0.2}}
    mesh = RunningMesh(config, tmp_path)
    mesh.start()
    try:
        everyone = {"prefill-0", "prefill-1", "decode-0"}
        replicas = replicas_seeing(mesh, everyone)

        def stats(address: str) -> admin_pb2.GetStatsResponse:
            return admin(mesh, address).GetStats(admin_pb2.GetStatsRequest(), timeout=2)

        load = SteadyLoad(mesh.http, "tandem-sim", clients=6, timeout_s=30).start()
        try:
            mesh.wait_for(lambda: load.count(ok=True) >= 12, 30, "load flowing")
            mesh.wait_for(lambda: stats(replicas[1]).requests_inflight >= 2, 10, "c1 deciding")
            status = json.loads((mesh.run_dir / "status.json").read_text())
            killed_at = time.monotonic()
            os.kill(status["coordinator-c1"]["pid"], signal.SIGKILL)
            served = load.count(ok=True)
            mesh.wait_for(lambda: load.count(ok=True) >= served + 12, 30, "the other replica decides")
            mesh.wait_for(lambda: healthy(mesh, replicas[1]) == everyone, 30, "c1 back, state from etcd")
            served = load.count(ok=True)
            mesh.wait_for(lambda: load.count(ok=True) >= served + 12, 30, "load after the restart")
        finally:
            load.stop()
        failed = [o for o in load.outcomes if not o.ok]
        counters = envoy_counters(mesh, "^cluster.coordinator.upstream_rq_(retry|retry_success|5xx)$")
        print(f"P/D coordinator replica killed: {load.report()}; decision streams retried: {counters}")
        # Nothing fails: the streams c1 was deciding (in their prefill leg) are opened again on c0, with the body
        # Envoy kept, and decided there; routed requests stream from their engines.
        assert failed == [], ([(round(o.started - killed_at, 2), o.error) for o in failed], counters)
        assert counters["cluster.coordinator.upstream_rq_retry"] >= 1, counters  # the kill caught some
        for address in replicas:
            mesh.wait_for(
                lambda a=address: stats(a).requests_inflight == 0, 30, f"workload back to zero on {address}"
            )
            final = stats(address)
            assert final.workload_tokens == 0 and all(i.workload_tokens == 0 for i in final.instances), final
    finally:
        if mesh.process.poll() is None:
            mesh.stop()

"""Chaos on the multi-node loopback layout (three nodes on 127.0.{1,2,3}.1): faults in turn under steady streaming
load. Where the mesh claims it (engine, agent, whole node, conductor, coordinator replica, etcd, hung engine), the
only failed requests are those already running on the process that died; every workload counter is back to zero at
the end."""

from __future__ import annotations

from bench.chaos import UpProcess, multi_node_config, run_chaos, table, wait, workload_zero
from tests.helpers import processes_mentioning


def test_faults_in_turn_under_streaming_load(tmp_path, etcd):
    # Two coordinator replicas sharing the etcd, two conductor replicas; the run kills and restarts etcd too.
    up = UpProcess(multi_node_config(engines_per_node=1, etcd=etcd.endpoint), tmp_path, etcd)
    up.start()
    try:
        results = run_chaos(up, clients=6, gap_s=0.5)
        print("\n" + table(results))
        for r in results:
            if r.collateral_free:
                assert r.collateral == 0, (r.fault, r.errors)
            assert r.ok > 0, r.fault  # served again after every fault
        wait(lambda: workload_zero(up), 60, "workload back to zero")
    finally:
        assert up.stop() == 0
    assert processes_mentioning(str(up.config_path)) == []
    assert processes_mentioning("tandem-chaos-n") == []  # no engine left (their runtime dirs name them)

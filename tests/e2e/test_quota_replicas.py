"""Tenant quotas hold mesh-wide with two coordinator replicas sharing a real etcd: a tenant limited to 30 requests
a minute gets about 30 through Envoy (which spreads the decisions over both replicas), not 30 per replica, and
its requests in flight return to zero on both."""

from __future__ import annotations

import math
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from tandem.v1 import admin_pb2
from tests.e2e.test_coordinator_replicas import admin, replicas_seeing
from tests.helpers import RunningMesh, mesh_config

LIMIT = 30  # requests a minute
SENT = 90
SHARE_DELAY_S = 0.3  # a share's interval (0.2 s) plus etcd's watch latency: docs/scheduling.md
COMPLETION = {"model": "tandem-sim", "prompt": "The quick brown fox", "max_tokens": 4}


def test_two_replicas_admit_one_mesh_wide_quota(tmp_path, etcd):
    config = mesh_config(engines=2, engine_args=["--speedup", "20"])
    config["coordinator"].update(
        replicas=2,
        etcd={"endpoint": etcd.endpoint, "prefix": "/quotas-e2e"},
        tenants=[{"name": "tiny", "keys": ["sk-tiny"], "requests_per_minute": LIMIT}],
    )
    mesh = RunningMesh(config, tmp_path)
    mesh.start()
    try:
        replicas = replicas_seeing(mesh, {"sim-0", "sim-1"})

        def send(_: int) -> int:
            headers = {"Authorization": "Bearer sk-tiny"}
            return httpx.post(
                mesh.http + "/v1/completions", json=COMPLETION, headers=headers, timeout=30
            ).status_code

        started = time.monotonic()
        with ThreadPoolExecutor(4) as pool:
            codes = list(pool.map(send, range(SENT)))
        elapsed = time.monotonic() - started

        def tenant(address: str) -> admin_pb2.TenantStats:
            (stats,) = admin(mesh, address).GetStats(admin_pb2.GetStatsRequest(), timeout=2).tenants
            return stats

        by_replica = [tenant(a).requests_admitted for a in replicas]
        refilled = elapsed * LIMIT / 60  # the bucket refills while the requests go
        print(
            f"mesh-wide quota: {codes.count(200)} of {SENT} admitted in {elapsed:.1f} s, per replica {by_replica}"
        )
        assert set(codes) == {200, 429}, codes
        assert all(n > 0 for n in by_replica), by_replica  # both replicas decided
        # Exact up to what the other replica admitted within one share's delay (coordinator/quotas.py: at most
        # (replicas - 1) x rate x 0.3 s; while its copy of the bucket has tokens, a replica admits every request it
        # gets: half of those sent a second).
        slack = math.ceil(SENT / elapsed / 2 * SHARE_DELAY_S)
        assert LIMIT - 1 <= codes.count(200) <= LIMIT + refilled + slack, (codes.count(200), refilled, slack)
        for address in replicas:
            mesh.wait_for(
                lambda a=address: tenant(a).requests_inflight == 0, 10, f"in flight back to 0 on {address}"
            )
    finally:
        assert mesh.stop() == 0

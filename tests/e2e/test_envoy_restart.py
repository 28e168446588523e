"""Envoy SIGKILLed under `tandem up`: clients are refused for less than a second each time, also when it is killed
again and again (a crash loop, or any local process asking `/quitquitquit`): `up.envoy_restart` starts it again at
once, with a backoff capped at 1 s, and `tandem up` notices the exit at once (a pidfd), not at its next tick.

Bounded: one engine, three kills, a few requests, a minute at most. On main the kills waited out a 0.5 s backoff
doubling with each (to 30 s) plus up to 0.2 s of polling: refused for 1.27, 1.74 and 2.82 s."""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest

from tests.helpers import RunningMesh, mesh_config, pid_alive, processes_mentioning, wait_until

KILLS = 3


@pytest.fixture
def mesh(tmp_path):
    running = RunningMesh(mesh_config(engines=1), tmp_path)
    running.start()
    yield running
    running.stop()


def envoy_pids(mesh: RunningMesh) -> list[int]:
    return processes_mentioning(str(mesh.run_dir / "envoy.yaml"))


def envoy_pid(mesh: RunningMesh) -> int:
    (pid,) = envoy_pids(mesh)
    return pid


def answers(mesh: RunningMesh) -> bool:
    """True when Envoy's ingress answers an HTTP request (any status: the client was not refused)."""
    try:
        httpx.get(mesh.http + "/v1/models", timeout=2)
    except httpx.TransportError:
        return False
    return True


def serves(mesh: RunningMesh) -> bool:
    payload = {"model": "tandem-sim", "prompt": "hi", "max_tokens": 4}
    try:
        return httpx.post(mesh.http + "/v1/completions", json=payload, timeout=10).status_code == 200
    except httpx.TransportError:
        return False


def test_killed_envoy_is_back_within_a_second_every_time(mesh):
    restarted_s: list[float] = []
    refused_s: list[float] = []
    for _ in range(KILLS):
        wait_until(lambda: serves(mesh), 20, "serving before the kill", interval=0.05)
        old = envoy_pid(mesh)
        os.kill(old, signal.SIGKILL)
        killed_at = time.monotonic()
        wait_until(lambda o=old: not pid_alive(o), 5, "the old Envoy gone", interval=0.01)
        wait_until(lambda o=old: envoy_pids(mesh) not in ([], [o]), 10, "Envoy started again", interval=0.01)
        restarted_s.append(time.monotonic() - killed_at)
        wait_until(lambda: answers(mesh), 10, "Envoy answering again", interval=0.01)
        refused_s.append(time.monotonic() - killed_at)
    print(
        f"Envoy SIGKILLed {KILLS} times in a row: started again after {[round(s, 2) for s in restarted_s]} s, "
        f"refused for {[round(s, 2) for s in refused_s]} s"
    )
    # What `tandem up` adds (main: 0.7, 1.2 and 2.2 s: a doubling backoff, 0.2 s polling) is at most a few
    # process-table scans; the rest is Envoy's own start-up, 0.4-0.7 s on this 2-core box when it is not shared,
    # over 1 s when other test suites load it: the bound leaves room for that and still fails main's third kill.
    assert max(restarted_s) < 0.5, restarted_s
    assert max(refused_s) < 2.0, refused_s
    # Serving again, through a restarted Envoy.
    wait_until(lambda: serves(mesh), 20, "served after the restarts", interval=0.1)

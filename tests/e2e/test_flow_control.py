"""SLO-aware admission through `tandem up`: two simulated engines whose SLOs (for the test, unmeetable by a busy
engine: each engine takes one request at a time) make the coordinator hold requests. A flood of `flex` requests
fills the flex queue and the rest get 429 `rejected: saturated` with `retry-after`; `priority` requests sent after
them are admitted ahead of the waiting flex ones; every admitted request completes; the OpenAI SDK's retry on the
429 succeeds; and the queue and in-flight gauges are back to zero. Each test first occupies both engines with a long
request (seconds), so the queue stays full while the test looks at it. Bounded: 2 long and 14 flex requests, 3
priority ones and one SDK call, each with a client timeout."""

from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest

from tests.helpers import RunningMesh, mesh_config, wait_until

GOLD = {"name": "gold", "keys": ["sk-gold"], "default_tier": "priority", "max_tier": "priority"}
BATCH = {"name": "batch", "keys": ["sk-batch"], "default_tier": "flex", "max_tier": "default"}
#: ~50 decode steps of the simulated 910B: a few tenths of a second per request.
BODY = {"model": "tandem-sim", "prompt": "The quick brown fox jumps over the lazy dog", "max_tokens": 48}
#: Several seconds of decoding: holds an engine while the queue behind it is filled and looked at.
LONG = {**BODY, "max_tokens": 480}
FLEX_QUEUED = 6
FLOOD = 14  # both engines busy: 6 waiting, the rest refused


@pytest.fixture(scope="module", params=["ext_authz", "ext_proc"])
def mesh(request, tmp_path_factory):
    config = mesh_config(engines=2, heartbeat_interval_s=0.25)
    # SLOs no engine meets, so that requests wait whenever one is busy; waits past them are what this queue is for.
    tier = {
        "ttft_slo_s": 1e-6,
        "tpot_slo_s": 1e-6,
        "max_queued": 16,
        "queue_ttl_s": 20.0,
        "refuse_late": False,
    }
    config["coordinator"]["tenants"] = [GOLD, BATCH]
    config["coordinator"]["flow_control"] = {
        "enabled": True,
        "priority": {**tier, "admit_on_expiry": True},
        "default": tier,
        "flex": {**tier, "max_queued": FLEX_QUEUED},
    }
    config["envoy"]["decision"] = request.param
    running = RunningMesh(config, tmp_path_factory.mktemp("flow"))
    running.start()
    yield running
    if running.process.poll() is None:
        running.stop()


def post(mesh: RunningMesh, key: str, results: list, index: int, body: dict = BODY) -> None:
    reply = httpx.post(
        mesh.http + "/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=60
    )
    results[index] = (reply, time.monotonic())


def occupy_engines(mesh: RunningMesh) -> tuple[list, list[threading.Thread]]:
    """One long flex request on each engine, admitted one after the other (each finds an idle engine)."""
    long: list = [None] * 2
    threads = [threading.Thread(target=post, args=(mesh, "sk-batch", long, i, LONG)) for i in range(2)]
    for i, t in enumerate(threads):
        t.start()
        wait_until(
            lambda n=i + 1: mesh.stats().requests_inflight == n, 20, f"{i + 1} long request(s) in flight"
        )
    return long, threads


def queued(mesh: RunningMesh, tier: str) -> float:
    return mesh.coordinator_metric("tandem_coordinator_queue_depth", tier=tier)


def test_flex_flood_is_queued_or_refused_and_priority_goes_first(mesh):
    long, long_threads = occupy_engines(mesh)
    flex: list = [None] * FLOOD
    threads = [threading.Thread(target=post, args=(mesh, "sk-batch", flex, i)) for i in range(FLOOD)]
    for t in threads:
        t.start()
    wait_until(lambda: queued(mesh, "flex") == FLEX_QUEUED, 20, "the flex queue full")
    prio: list = [None] * 3
    sent_at = time.monotonic()
    prio_threads = [threading.Thread(target=post, args=(mesh, "sk-gold", prio, i)) for i in range(3)]
    for t in prio_threads:
        t.start()
    for t in [*long_threads, *threads, *prio_threads]:
        t.join(90)
    assert all(r is not None for r in long + flex + prio), "a request never came back"
    assert all(r.status_code == 200 for r, _ in long)

    refused = [r for r, _ in flex if r.status_code == 429]
    served = [(r, at) for r, at in flex if r.status_code == 200]
    assert len(refused) == FLOOD - FLEX_QUEUED and len(served) == FLEX_QUEUED, [
        (r.status_code, r.text) for r, _ in flex if r.status_code not in (200, 429)
    ]
    for reply in refused:
        error = reply.json()["error"]
        assert error["message"] == "rejected: saturated" and error["code"] == "rate_limit_exceeded"
        assert 1 <= int(reply.headers["retry-after"]) <= 60
    assert all(r.status_code == 200 for r, _ in prio), [r.text for r, _ in prio]
    # The priority requests, sent while six flex ones waited, were all served before the last of those.
    last_flex = max(at for _, at in served)
    assert all(sent_at < at < last_flex for _, at in prio)

    wait_until(lambda: mesh.stats().requests_inflight == 0, 20, "every request's end reached the coordinator")
    queues = {(q.tier, q.tenant): q for q in mesh.stats().queues}
    flex_q, prio_q = queues[("flex", "batch")], queues[("priority", "gold")]
    assert flex_q.shed_saturated == len(refused) and flex_q.released == FLEX_QUEUED
    assert prio_q.released + prio_q.admitted_at_once == 3 and prio_q.shed_expired == 0
    if prio_q.released and flex_q.released:  # priority waited less, on average, than flex
        assert prio_q.released_wait_seconds / prio_q.released < flex_q.released_wait_seconds / flex_q.released
    assert all(q.queued_now == 0 for q in queues.values())
    assert mesh.coordinator_metric("tandem_coordinator_shed_total", tier="flex", reason="saturated") == len(
        refused
    )


def test_the_openai_sdk_retries_the_429_and_every_gauge_is_back_to_zero(mesh):
    long, long_threads = occupy_engines(mesh)
    flood: list = [None] * FLEX_QUEUED
    threads = [threading.Thread(target=post, args=(mesh, "sk-batch", flood, i)) for i in range(len(flood))]
    for t in threads:
        t.start()
    wait_until(lambda: queued(mesh, "flex") == FLEX_QUEUED, 20, "the flex queue full")
    seen: list[int] = []
    http_client = httpx.Client(event_hooks={"response": [lambda r: seen.append(r.status_code)]}, timeout=60)
    sdk = openai.OpenAI(
        base_url=mesh.http + "/v1", api_key="sk-batch", max_retries=4, http_client=http_client
    )
    completion = sdk.completions.create(model="tandem-sim", prompt="hello", max_tokens=2)
    http_client.close()
    assert completion.usage.completion_tokens == 2
    assert seen[0] == 429 and seen[-1] == 200, seen
    for t in [*long_threads, *threads]:
        t.join(90)
    assert all(r is not None and r[0].status_code == 200 for r in long + flood)

    def idle() -> bool:
        s = mesh.stats()
        return s.requests_inflight == 0 and all(q.queued_now == 0 for q in s.queues)

    wait_until(idle, 20, "nothing in flight or queued")
    for tier in ("priority", "default", "flex"):
        assert queued(mesh, tier) == 0
    assert mesh.coordinator_metric("tandem_coordinator_inflight_requests") == 0
    assert all(t.requests_inflight == 0 for t in mesh.stats().tenants)

"""Decode-first trigger mode through Envoy (examples/pd-trigger.yaml's layout): the decode engine's metaserver
callback reaches `Metaserver.Trigger` through Envoy's JSON transcoding and starts exactly one prefill leg."""

from __future__ import annotations

import concurrent.futures
import json
import socket
import ssl

import httpx
import pytest

from tandem.netaddr import split_host_port
from tandem.v1 import admin_pb2
from tests.helpers import RunningMesh, mesh_config, metric_sum

PROMPT = " ".join(f"token{i}" for i in range(120))
LAYERWISE = "MooncakeLayerwiseConnector"


def trigger_config(ipv6: bool = False) -> dict:
    config = mesh_config(engines=3, engine_args=["--speedup", "20"], policy="kv_affinity")
    engines = config["node_agents"][0]["engines"]
    roles = [("prefill-0", "prefill"), ("prefill-1", "prefill"), ("decode-0", "decode")]
    for engine, (iid, role) in zip(engines, roles, strict=True):
        engine.update(instance_id=iid, role=role, kv_connector=LAYERWISE)
    # The decode engine posts every callback twice (a retrying engine): never a second prefill leg.
    engines[2]["args"] += ["--fault-duplicate-callbacks"]
    # prefill-1 is slow, to catch a client leaving during the prefill leg.
    engines[1]["args"] += ["--fault-latency-ms", "1500"]
    config["coordinator"]["pd_mode"] = "concurrent_engine_sync"
    if ipv6:
        text = json.dumps(config).replace('"127.0.0.1:', '"[::1]:')
        config = json.loads(text)
        for engine in config["node_agents"][0]["engines"]:
            engine["host"] = "::1"
    return config


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    running = RunningMesh(trigger_config(), tmp_path_factory.mktemp("trigger"))
    running.start()
    yield running
    running.stop()


def served(mesh, iid: str) -> float:
    """Requests the engine completed (aborted ones do not count)."""
    address = mesh.engine_address(iid)
    return sum(
        metric_sum(address, "vllm:request_success_total", finished_reason=r) for r in ("stop", "length")
    )


def prefill_legs(mesh) -> float:
    return served(mesh, "prefill-0") + served(mesh, "prefill-1")


def set_drained(mesh, iid: str, drained: bool) -> None:
    admin = mesh.admin()
    if drained:
        admin.DrainInstance(admin_pb2.DrainInstanceRequest(instance_id=iid), timeout=5)
    else:
        admin.UndrainInstance(admin_pb2.UndrainInstanceRequest(instance_id=iid), timeout=5)


def text_of(reply: dict, chat: bool) -> str:
    return reply["choices"][0]["message"]["content"] if chat else reply["choices"][0]["text"]


@pytest.mark.parametrize("chat", [False, True])
def test_answers_equal_the_aggregated_ones_with_one_prefill_leg_each(mesh, chat):
    set_drained(mesh, "prefill-1", True)  # the fast prefill engine only
    try:
        path = "/v1/chat/completions" if chat else "/v1/completions"
        payload = {"model": "tandem-sim", "max_tokens": 16}
        payload |= {"messages": [{"role": "user", "content": PROMPT}]} if chat else {"prompt": PROMPT}
        reference = httpx.post(
            f"http://{mesh.engine_address('decode-0')}{path}", json=payload, timeout=30
        ).json()
        legs = prefill_legs(mesh)
        reply = httpx.post(mesh.http + path, json=payload, timeout=30)
        assert reply.status_code == 200, reply.text
        assert text_of(reply.json(), chat) == text_of(reference, chat)
        with httpx.stream("POST", mesh.http + path, json={**payload, "stream": True}, timeout=30) as stream:
            events = [line[6:] for line in stream.iter_lines() if line.startswith("data: ")]
        chunks = [json.loads(e) for e in events[:-1]]
        pieces = [
            (c["choices"][0].get("delta", {}).get("content") if chat else c["choices"][0]["text"]) or ""
            for c in chunks
            if c["choices"]
        ]
        assert events[-1] == "[DONE]" and "".join(pieces) == text_of(reference, chat)
        assert prefill_legs(mesh) == legs + 2  # duplicated callbacks, still one prefill leg per request
    finally:
        set_drained(mesh, "prefill-1", False)


def test_unknown_callback_is_refused_as_a_wrong_token_through_envoy(mesh):
    url = f"https://{mesh.callback_address}/v1/metaserver/c0/not-a-token"
    reply = httpx.post(
        url,
        json={"request_id": "cmpl-unknown-0", "remote_block_ids": [[1]], "remote_port": 1},
        verify=ssl.create_default_context(cafile=str(mesh.certs / "ca.pem")),
    )
    assert reply.status_code == 403 and "token does not belong" in reply.json()["message"]


def prefill_tokens_on(mesh, iid: str) -> int:
    listed = mesh.admin().ListInstances(admin_pb2.ListInstancesRequest(), timeout=5).instances
    return next(i.prefill_tokens for i in listed if i.instance.instance_id == iid)


def test_client_leaving_during_the_prefill_leg_cancels_it_and_releases_everything(mesh):
    set_drained(mesh, "prefill-0", True)  # legs go to the slow prefill-1
    try:
        before = served(mesh, "prefill-1")
        legs = "tandem_coordinator_prefill_legs_total"
        cancelled = mesh.coordinator_metric(legs, outcome="cancelled")
        body = json.dumps({"model": "tandem-sim", "prompt": PROMPT}).encode()
        host, port = split_host_port(mesh.config["envoy"]["http_listen"])
        with socket.create_connection((host, port)) as client:
            client.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: tandem\r\nContent-Type: application/json\r\n"
                + f"Content-Length: {len(body)}\r\n\r\n".encode()
                + body
            )
            mesh.wait_for(lambda: prefill_tokens_on(mesh, "prefill-1") > 0, 10, "the prefill leg in flight")
        # the client is gone while the leg runs
        mesh.wait_for(lambda: mesh.stats().requests_inflight == 0, 10, "in-flight back to zero")
        assert mesh.stats().workload_tokens == 0
        assert mesh.coordinator_metric(legs, outcome="cancelled") == cancelled + 1
        # A later request with the same prompt has its leg on prefill-1 too, with the same latency: once it is
        # served, the cancelled leg would have been served as well had it not been aborted there.
        probe = {"model": "tandem-sim", "prompt": PROMPT, "max_tokens": 2}
        assert httpx.post(mesh.http + "/v1/completions", json=probe, timeout=30).status_code == 200
        assert served(mesh, "prefill-1") == before + 1
    finally:
        set_drained(mesh, "prefill-0", False)


def burst(mesh, count: int) -> list[int]:
    def one(i: int) -> int:
        payload = {"model": "tandem-sim", "prompt": f"{i} " + PROMPT, "max_tokens": 8, "stream": i % 2 == 0}
        reply = httpx.post(mesh.http + "/v1/completions", json=payload, timeout=120)
        return reply.status_code

    with concurrent.futures.ThreadPoolExecutor(64) as pool:
        return list(pool.map(one, range(count)))


def test_200_concurrent_requests_no_double_prefill_no_leak_no_loss(mesh):
    set_drained(mesh, "prefill-1", True)
    try:
        legs = served(mesh, "prefill-0")
        assert burst(mesh, 200) == [200] * 200
        assert served(mesh, "prefill-0") == legs + 200
        mesh.wait_for(lambda: mesh.stats().requests_inflight == 0, 10, "in-flight back to zero")
        assert mesh.stats().workload_tokens == 0
    finally:
        set_drained(mesh, "prefill-1", False)


def test_every_address_on_ipv6_loopback(tmp_path):
    running = RunningMesh(trigger_config(ipv6=True), tmp_path)
    running.start()
    try:
        assert "[::1]" in running.http
        set_drained(running, "prefill-1", True)
        assert burst(running, 6) == [200] * 6
        assert prefill_legs(running) == 6
    finally:
        running.stop()

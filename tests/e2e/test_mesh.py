"""The first slice as a new user sees it: `tandem up`, then curl-like HTTP, the OpenAI SDK and grpcurl."""

from __future__ import annotations

import json
import os
import subprocess

import httpx
import openai
import pytest

from tandem.v1 import admin_pb2, node_agent_pb2
from tests.helpers import (
    GRPCURL,
    RunningMesh,
    mesh_config,
    metric_sum,
    pid_alive,
    processes_mentioning,
    wait_until,
)

CHAT = {
    "model": "tandem-sim",
    "messages": [{"role": "user", "content": "Tell me about Envoy."}],
    "max_tokens": 12,
}
COMPLETION = {"model": "tandem-sim", "prompt": "The quick brown fox", "max_tokens": 12}


@pytest.fixture(scope="module", params=["ext_authz", "ext_proc"])
def mesh(request, tmp_path_factory):
    """The mesh on each decision path (an aggregated mesh picks ext_authz by itself; ext_proc is forced)."""
    config = mesh_config(engines=2, engine_args=["--speedup", "20"])
    config["envoy"]["decision"] = request.param
    running = RunningMesh(config, tmp_path_factory.mktemp("mesh"))
    running.start()
    yield running
    if running.process.poll() is None:
        running.stop()


def sse_events(text: str) -> list[str]:
    return [line[len("data: ") :] for line in text.splitlines() if line.startswith("data: ")]


@pytest.mark.parametrize("path,payload", [("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)])
def test_openai_shaped_answers(mesh, path, payload):
    reply = httpx.post(mesh.http + path, json=payload, headers={"X-Request-Id": "e2e-1"}, timeout=30)
    assert reply.status_code == 200, reply.text
    # The engine saw an id the coordinator minted; the client gets its own back.
    assert reply.headers["x-request-id"] == "e2e-1"
    data = reply.json()
    assert data["object"] == ("chat.completion" if "chat" in path else "text_completion")
    assert data["usage"]["completion_tokens"] == 12 and data["usage"]["prompt_tokens"] > 0
    text = data["choices"][0]["message"]["content"] if "chat" in path else data["choices"][0]["text"]
    assert text
    again = httpx.post(mesh.http + path, json=payload, timeout=30).json()
    again_text = again["choices"][0]["message"]["content"] if "chat" in path else again["choices"][0]["text"]
    assert again_text == text  # deterministic for a prompt, whichever engine served it


@pytest.mark.parametrize("path,payload", [("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)])
def test_streaming_answers_end_with_done(mesh, path, payload):
    with httpx.stream("POST", mesh.http + path, json={**payload, "stream": True}, timeout=30) as reply:
        assert reply.status_code == 200
        assert reply.headers["content-type"].startswith("text/event-stream")
        events = sse_events(reply.read().decode())
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks and all(c["object"].endswith(".chunk") or c["object"] == "text_completion" for c in chunks)


def test_openai_sdk(mesh):
    client = openai.OpenAI(base_url=mesh.http + "/v1", api_key="unused")
    chat = client.chat.completions.create(model="tandem-sim", messages=CHAT["messages"], max_tokens=8)
    assert chat.choices[0].message.content and chat.usage.completion_tokens == 8
    stream = client.completions.create(model="tandem-sim", prompt="hello", max_tokens=5, stream=True)
    assert "".join(c.choices[0].text for c in stream if c.choices)
    assert [m.id for m in client.models.list()] == ["tandem-sim"]


def test_grpcurl_lists_services_and_health(mesh):
    listed = subprocess.run(
        [GRPCURL, *mesh.grpcurl_flags(), mesh.grpc_address, "list"],
        capture_output=True,
        text=True,
        timeout=20,
    )
    assert listed.returncode == 0, listed.stderr
    services = set(listed.stdout.split())
    for name in ("Admin", "Registry", "Metaserver", "Conductor", "NodeAgent"):
        assert f"tandem.v1.{name}" in services
        check = subprocess.run(
            [
                GRPCURL,
                *mesh.grpcurl_flags(),
                "-d",
                json.dumps({"service": f"tandem.v1.{name}"}),
                mesh.grpc_address,
                "grpc.health.v1.Health/Check",
            ],
            capture_output=True,
            text=True,
            timeout=20,
        )
        assert json.loads(check.stdout)["status"] == "SERVING", (name, check.stdout, check.stderr)
    instances = subprocess.run(
        [GRPCURL, *mesh.grpcurl_flags(), mesh.grpc_address, "tandem.v1.Admin/ListInstances"],
        capture_output=True,
        text=True,
    )
    listed_ids = [i["instance"]["instance_id"] for i in json.loads(instances.stdout)["instances"]]
    assert listed_ids == ["sim-0", "sim-1"]
    # Methods of the other processes resolve through the same reflection and reach the right process.
    agent = subprocess.run(
        [GRPCURL, *mesh.grpcurl_flags(), mesh.grpc_address, "tandem.v1.NodeAgent/GetStatus"],
        capture_output=True,
        text=True,
    )
    assert agent.returncode == 0, agent.stderr
    assert [e["state"] for e in json.loads(agent.stdout)["engines"]] == ["ENGINE_STATE_RUNNING"] * 2
    index = subprocess.run(
        [GRPCURL, *mesh.grpcurl_flags(), mesh.grpc_address, "tandem.v1.Conductor/GetIndexStats"],
        capture_output=True,
        text=True,
    )
    assert index.returncode == 0, index.stderr


@pytest.mark.parametrize(
    ("body", "status", "fragment"),
    [
        (b'{"model": "tandem-sim", "messages": [', 400, "not valid JSON"),
        (json.dumps({"model": "nope", "prompt": "x"}).encode(), 404, "does not exist"),
        (json.dumps({"model": "tandem-sim", "prompt": "x", "max_tokens": -1}).encode(), 400, "max_tokens"),
    ],
)
def test_errors_are_openai_json(mesh, body, status, fragment):
    reply = httpx.post(
        mesh.http + "/v1/completions", content=body, headers={"content-type": "application/json"}
    )
    assert reply.status_code == status
    error = reply.json()["error"]
    assert error["code"] == status and fragment in error["message"]


@pytest.mark.parametrize(
    ("method", "path", "body", "status"),
    [
        ("GET", "/v1/completions", None, 405),
        ("POST", "/v1/embeddings", b"{}", 404),
        ("POST", "/v1/completions", b"", 400),
    ],
)
def test_requests_outside_the_routed_paths_get_openai_errors(mesh, method, path, body, status):
    reply = httpx.request(method, mesh.http + path, content=body, timeout=30)
    assert reply.status_code == status, reply.text
    assert reply.json()["error"]["code"] == status


def test_a_client_cannot_choose_the_engine(mesh):
    headers = {"x-tandem-destination": "127.0.0.1:1"}
    reply = httpx.post(mesh.http + "/v1/completions", json=COMPLETION, headers=headers, timeout=30)
    assert reply.status_code == 200, reply.text


def test_workload_returns_to_zero_after_disconnects(mesh):
    payload = {**COMPLETION, "max_tokens": 400, "stream": True}
    for _ in range(3):
        with httpx.stream("POST", mesh.http + "/v1/completions", json=payload, timeout=30) as reply:
            next(reply.iter_lines())  # first event, then the client goes away
    mesh.wait_for(lambda: mesh.stats().requests_inflight == 0, 10, "in-flight requests back to zero")
    stats = mesh.stats()
    assert stats.workload_tokens == 0 and all(i.workload_tokens == 0 for i in stats.instances)


def test_prometheus_metrics_of_coordinator_and_agent(mesh):
    agent = mesh.config["node_agents"][0]["metrics_listen"]
    for iid in ("sim-0", "sim-1"):
        assert metric_sum(agent, "tandem_node_agent_engine_healthy", instance=iid) == 1
        assert metric_sum(agent, "tandem_node_agent_process_state", instance=iid, state="running") == 1
    assert metric_sum(agent, "tandem_node_agent_kv_batches_relayed_total") > 0  # the engines' KV events
    assert mesh.coordinator_metric("tandem_coordinator_routed_requests_total") > 0
    assert mesh.coordinator_metric("tandem_coordinator_workload_tokens", bucket="prefill") == 0


def test_killed_engine_is_restarted_while_the_other_serves(mesh):
    victim = mesh.engines()["sim-0"]
    os.kill(victim.pid, 9)
    mesh.wait_for(
        lambda: mesh.engines()["sim-0"].state != node_agent_pb2.ENGINE_STATE_RUNNING, 10, "crash noticed"
    )
    for _ in range(10):
        assert httpx.post(mesh.http + "/v1/completions", json=COMPLETION, timeout=30).status_code == 200
    mesh.wait_for(lambda: mesh.engines()["sim-0"].state == node_agent_pb2.ENGINE_STATE_RUNNING, 30, "restart")
    restarted = mesh.engines()["sim-0"]
    assert restarted.restarts == 1 and restarted.pid != victim.pid and restarted.last_exit_code == -9
    mesh.wait_for(
        lambda: (
            len(
                [
                    i
                    for i in mesh.admin().ListInstances(admin_pb2.ListInstancesRequest()).instances
                    if i.health == 2
                ]
            )
            == 2
        ),
        10,
        "re-registration",
    )


def test_all_engines_stopped_gives_503_then_recovers(mesh):
    agent = mesh.agent()
    for iid in ("sim-0", "sim-1"):
        agent.Stop(node_agent_pb2.StopRequest(instance_id=iid), timeout=30)
    reply = httpx.post(mesh.http + "/v1/chat/completions", json=CHAT, timeout=30)
    assert reply.status_code == 503 and "No healthy instance" in reply.json()["error"]["message"]
    for iid in ("sim-0", "sim-1"):
        agent.Launch(node_agent_pb2.LaunchRequest(instance_id=iid), timeout=30)
    mesh.wait_for(
        lambda: httpx.post(mesh.http + "/v1/chat/completions", json=CHAT, timeout=30).status_code == 200,
        30,
        "engines back",
    )


def test_ctrl_c_leaves_no_process_behind(mesh):
    spare = mesh.wait_for(
        lambda: mesh.up_status("coordinator").get("spare_pid"), 30, "the coordinator's spare"
    )
    engine_pids = [e.pid for e in mesh.engines().values() if e.pid]
    component_pids = processes_mentioning(str(mesh.config_path)) + processes_mentioning(str(mesh.run_dir))
    assert len(engine_pids) == 2 and len(component_pids) >= 5 and spare in component_pids
    assert mesh.stop() == 0
    wait_until(lambda: not any(map(pid_alive, engine_pids + component_pids)), 10, "every process to exit")
    assert "tandem up: stopped" in mesh.output.read_text()

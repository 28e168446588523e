"""KV-aware routing end to end: engines' KV events reach the conductor through the agent; the coordinator's
`kv_affinity` follows them; without the conductor it still serves, on load alone, and counts the fallback."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import urllib.request

import httpx
import pytest

from bench.engines import engine_counters
from bench.harness import mesh_config
from tandem.tokenizer import load_tokenizer
from tests.e2e.mesh import RunningMesh, processes_mentioning
from tests.e2e.test_mesh import GRPCURL

SHARED = "You are a careful assistant. " + " ".join(f"rule{i} applies" for i in range(120))


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    running = RunningMesh(
        mesh_config(engines=2, engine_args=["--speedup", "20"], policy="kv_affinity"), tmp_path_factory.mktemp("kv")
    )
    running.start()
    yield running
    running.stop()


def hits(mesh) -> dict[str, float]:
    out = {}
    for e in mesh.config["node_agents"][0]["engines"]:
        c = engine_counters(f"127.0.0.1:{e['port']}", ("vllm:prefix_cache_hits_total",))
        out[e["instance_id"]] = c["vllm:prefix_cache_hits_total"]
    return out


def grpc_match(mesh, prompt: str) -> dict:
    tokens = load_tokenizer(None).encode(prompt)
    body = json.dumps({"request_id": "t", "model": "tandem-sim", "token_ids": tokens})
    out = subprocess.run(
        [GRPCURL, "-plaintext", "-d", body, mesh.grpc_address, "tandem.v1.Conductor/Match"],
        capture_output=True, text=True, timeout=20,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def complete(mesh, prompt: str) -> None:
    reply = httpx.post(mesh.http + "/v1/completions", json={"model": "tandem-sim", "prompt": prompt, "max_tokens": 4},
                       timeout=30)
    assert reply.status_code == 200, reply.text


def test_shared_prefix_follows_the_cache_and_unrelated_requests_spread(mesh):
    complete(mesh, SHARED + " First question?")
    # The conductor learns where the prefix lives from the engine's KV events, relayed by the agent.
    mesh.wait_for(lambda: grpc_match(mesh, SHARED).get("instances"), 10, "the conductor to index the prompt")
    match = grpc_match(mesh, SHARED)
    assert len(match["instances"]) == 1
    holder = match["instances"][0]["instance_id"]
    rank = match["instances"][0]["ranks"][0]
    assert int(rank["npu_blocks"]) > 0 and "cpu_blocks" not in rank and "disk_blocks" not in rank
    before = hits(mesh)
    for i in range(5):
        complete(mesh, SHARED + f" Question number {i}?")
    after = hits(mesh)
    other = next(i for i in after if i != holder)
    assert after[holder] - before[holder] >= 5 * 100  # each request reused the long shared prefix there
    assert after[other] == before[other]
    served_before = routed(mesh)
    for i in range(6):
        complete(mesh, f"Unrelated prompt {i}: " + " ".join(f"topic{i}x{j}" for j in range(40)))
    served = {k: routed(mesh)[k] - served_before.get(k, 0) for k in routed(mesh)}
    assert min(served.values()) >= 2, served  # unrelated work is spread over both engines


def routed(mesh) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://{mesh.config['coordinator']['metrics_listen']}/metrics").read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("tandem_coordinator_routed_requests_total{"):
            out[line.split('instance="')[1].split('"')[0]] = float(line.rsplit(" ", 1)[1])
    return out


def fallbacks(mesh) -> float:
    text = urllib.request.urlopen(f"http://{mesh.config['coordinator']['metrics_listen']}/metrics").read().decode()
    return sum(float(l.rsplit(" ", 1)[1]) for l in text.splitlines()
               if l.startswith("tandem_coordinator_match_fallbacks_total"))


def test_conductor_down_still_serves_and_counts_the_fallback(mesh):
    conductor = [p for p in processes_mentioning(str(mesh.config_path)) if b"conductor" in open(f"/proc/{p}/cmdline", "rb").read()]
    assert len(conductor) == 1
    os.kill(conductor[0], signal.SIGKILL)
    before = fallbacks(mesh)
    for i in range(3):
        complete(mesh, SHARED + f" After the conductor left {i}?")
    assert fallbacks(mesh) >= before + 3

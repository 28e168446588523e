"""P/D handoff through Envoy with simulated prefill and decode engines (examples/pd-handoff.yaml's layout)."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.helpers import RunningMesh, mesh_config, metric_sum

PROMPT = " ".join(f"word{i}" for i in range(150))  # several full 16-token blocks


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    config = mesh_config(engines=3, engine_args=["--speedup", "20"], policy="kv_affinity")
    engines = config["node_agents"][0]["engines"]
    roles = [("prefill-0", "prefill"), ("prefill-1", "prefill"), ("decode-0", "decode")]
    for engine, (iid, role) in zip(engines, roles, strict=True):
        engine.update(instance_id=iid, role=role, kv_connector="NixlConnector")
    config["coordinator"]["pd_mode"] = "prefill_handoff_decode"
    running = RunningMesh(config, tmp_path_factory.mktemp("pd"))
    running.start()
    yield running
    running.stop()


def transferred(mesh) -> float:
    return metric_sum(mesh.engine_address("decode-0"), "simengine:kv_transfer_tokens_total")


@pytest.mark.parametrize("api", ["completions", "chat"])
def test_answers_equal_the_aggregated_ones_and_kv_moves(mesh, api):
    if api == "chat":
        path, payload = "/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPT}]}
    else:
        path, payload = "/v1/completions", {"prompt": PROMPT}
    payload = {"model": "tandem-sim", "max_tokens": 20, **payload}
    before = transferred(mesh)
    # Aggregated reference: the same body served whole by one engine.
    direct = httpx.post(f"http://{mesh.engine_address('prefill-0')}{path}", json=payload, timeout=30).json()
    through = httpx.post(mesh.http + path, json=payload, timeout=30)
    assert through.status_code == 200, through.text

    def text(d: dict) -> str:
        return d["choices"][0]["message"]["content"] if api == "chat" else d["choices"][0]["text"]

    assert text(through.json()) == text(direct)
    assert transferred(mesh) > before  # the decode engine pulled the prefill's KV
    with httpx.stream("POST", mesh.http + path, json={**payload, "stream": True}, timeout=30) as reply:
        events = [line[6:] for line in reply.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    streamed = "".join(
        (c["choices"][0].get("delta", {}).get("content") or "") if api == "chat" else c["choices"][0]["text"]
        for c in map(json.loads, events[:-1])
        if c["choices"]
    )
    assert streamed == text(direct)


def test_workload_back_to_zero_after_a_burst_with_disconnects(mesh):
    import concurrent.futures

    payload = {"model": "tandem-sim", "prompt": PROMPT, "max_tokens": 200, "stream": True}

    def one(i: int) -> int:
        with httpx.stream("POST", mesh.http + "/v1/completions", json=payload, timeout=30) as reply:
            if i % 3 == 0:
                next(reply.iter_lines())  # the client goes away mid-answer
                return reply.status_code
            reply.read()
            return reply.status_code

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        codes = list(pool.map(one, range(24)))
    assert codes == [200] * 24
    mesh.wait_for(lambda: mesh.stats().requests_inflight == 0, 15, "in-flight back to zero")
    stats = mesh.stats()
    assert stats.workload_tokens == 0 and all(i.workload_tokens == 0 for i in stats.instances)

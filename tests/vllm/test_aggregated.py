"""Two real CPU vLLM engines launched by the agent: answers through Envoy, real KV events in the conductor,
`kv_affinity` following them."""

from __future__ import annotations

import json

import httpx
import pytest

from tandem.tokenizer import load_tokenizer
from tandem.v1 import conductor_pb2, conductor_pb2_grpc, node_agent_pb2
from tests.helpers import metric_sum
from tests.vllm.conftest import MODEL, MODEL_NAME, real_mesh, start

SHARED = "You are a careful assistant for platform engineers. " + " ".join(
    f"rule {i} applies here" for i in range(60)
)


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("aggregated")
    running = start(real_mesh([("vllm-0", "hybrid", None), ("vllm-1", "hybrid", None)], workdir), workdir)
    yield running
    assert running.stop() == 0


def complete(mesh, prompt: str, max_tokens: int = 4, **extra) -> httpx.Response:
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, **extra}
    return httpx.post(mesh.http + "/v1/completions", json=body, timeout=120)


def test_agent_launched_real_engines(mesh):
    engines = mesh.engines()
    assert set(engines) == {"vllm-0", "vllm-1"}
    for status in engines.values():
        assert status.state == node_agent_pb2.ENGINE_STATE_RUNNING
        assert status.instance.backend == "vllm" and status.instance.block_size == 32
        argv = list(status.argv)
        assert argv[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
        assert json.loads(argv[argv.index("--kv-events-config") + 1])["endpoint"].startswith("ipc://")


def test_completions_chat_and_streaming_through_envoy(mesh):
    reply = complete(mesh, "The quick brown fox jumps over the lazy dog. " * 3, max_tokens=8)
    assert reply.status_code == 200, reply.text
    data = reply.json()
    assert data["object"] == "text_completion" and data["usage"]["completion_tokens"] == 8
    chat = httpx.post(
        mesh.http + "/v1/chat/completions",
        json={
            "model": MODEL_NAME,
            "messages": [{"role": "user", "content": "Tell me about Envoy. " * 4}],
            "max_tokens": 6,
        },  # fmt: skip
        timeout=120,
    )
    assert chat.status_code == 200, chat.text
    assert chat.json()["choices"][0]["message"]["content"] is not None
    with httpx.stream(
        "POST", mesh.http + "/v1/completions", timeout=120,
        json={"model": MODEL_NAME, "prompt": "Streaming answers end with done. " * 3, "max_tokens": 6, "stream": True},
    ) as stream:  # fmt: skip
        assert stream.status_code == 200
        events = [line[6:] for line in stream.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and len(events) >= 2


def holders(mesh, prompt: str) -> dict[str, int]:
    """Instance -> NPU ("GPU") blocks the conductor holds for `prompt`, from the engines' real KV events."""
    tokens = load_tokenizer(MODEL).encode(prompt)
    with mesh.channel() as channel:
        stub = conductor_pb2_grpc.ConductorStub(channel)
        reply = stub.Match(
            iter([conductor_pb2.MatchRequest(request_id="t", model=MODEL_NAME, token_ids=tokens)])
        )
        answer = next(iter(reply))
    return {i.instance_id: max(r.npu_blocks for r in i.ranks) for i in answer.instances}


def routed(mesh) -> dict[str, float]:
    return {
        iid: mesh.coordinator_metric("tandem_coordinator_routed_requests_total", instance=iid)
        for iid in ("vllm-0", "vllm-1")
    }


def test_conductor_holds_real_events_and_kv_affinity_follows_them(mesh):
    assert complete(mesh, SHARED + " First question?").status_code == 200
    mesh.wait_for(lambda: holders(mesh, SHARED), 20, "the conductor to index the prompt from real KV events")
    held = holders(mesh, SHARED)
    assert len(held) == 1
    ((holder, blocks),) = held.items()
    assert blocks >= len(load_tokenizer(MODEL).encode(SHARED)) // 32 - 1
    hits_before = metric_sum(mesh.engine_address(holder), "vllm:prefix_cache_hits_total")
    before = routed(mesh)
    for i in range(4):
        assert complete(mesh, SHARED + f" Question number {i}?").status_code == 200
    after = routed(mesh)
    fallbacks = {
        reason: mesh.coordinator_metric("tandem_coordinator_match_fallbacks_total", reason=reason)
        for reason in ("timeout", "unavailable")
    }
    assert after[holder] - before[holder] == 4, (holder, before, after, "scored on load alone:", fallbacks)
    assert metric_sum(mesh.engine_address(holder), "vllm:prefix_cache_hits_total") > hits_before

"""A P/D handoff pair of real CPU vLLM engines with the ExampleConnector (KV through a shared directory)."""

from __future__ import annotations

import httpx
import pytest

from tests.e2e.mesh import metric_sum
from tests.vllm.conftest import MODEL_NAME, real_mesh, start

PROMPT = "Disaggregated serving moves the prompt's KV cache from prefill to decode. " * 6


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    config = real_mesh(
        [("prefill-0", "prefill", "ExampleConnector"), ("decode-0", "decode", "ExampleConnector")],
        pd_mode="prefill_handoff_decode",
    )
    running = start(config, tmp_path_factory.mktemp("pd"))
    yield running
    assert running.stop() == 0


def test_pair_registers_as_handoff(mesh):
    engines = mesh.engines()
    for iid in ("prefill-0", "decode-0"):
        instance = engines[iid].instance
        assert instance.kv_connector == "ExampleConnector" and instance.dispatch_capability == 2  # HANDOFF


def test_pd_pair_answers_through_envoy(mesh):
    reply = httpx.post(
        mesh.http + "/v1/completions", json={"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 8}, timeout=180
    )
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] == 8
    # The decode engine loaded the prompt's KV that the prefill engine saved, instead of computing it.
    decode = mesh.engine_address("decode-0")
    names = ("vllm:external_prefix_cache_hits_total", "vllm:prompt_tokens_by_source_total")
    loaded = metric_sum(decode, names[0]) + metric_sum(decode, names[1], source="external_kv_transfer")
    assert loaded > 0

"""A P/D handoff pair of real CPU vLLM engines with the ExampleConnector (KV through a shared directory)."""

from __future__ import annotations

import httpx
import pytest

from tests.helpers import metric_sum, wait_until
from tests.vllm.conftest import MODEL_NAME, real_mesh, start

PROMPT = "Disaggregated serving moves the prompt's KV cache from prefill to decode. " * 6


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("pd")
    config = real_mesh(
        [("prefill-0", "prefill", "ExampleConnector"), ("decode-0", "decode", "ExampleConnector")],
        workdir,
        pd_mode="prefill_handoff_decode",
    )
    running = start(config, workdir)
    yield running
    assert running.stop() == 0


def external_tokens(mesh, instance_id: str) -> float:
    """Prompt tokens the engine loaded through its connector instead of computing them."""
    return metric_sum(
        mesh.engine_address(instance_id), "vllm:prompt_tokens_by_source_total", source="external_kv_transfer"
    )


def wait_loaded(mesh, before: float) -> None:
    """Waits until decode-0 counted external tokens beyond `before` (vLLM records its metrics after the reply); on
    failure, says where its prompt tokens came from instead."""
    try:
        wait_until(
            lambda: external_tokens(mesh, "decode-0") > before,
            15,
            "decode-0 loading KV through its connector",
        )
    except AssertionError as exc:
        address = mesh.engine_address("decode-0")
        sources = {
            source: metric_sum(address, "vllm:prompt_tokens_by_source_total", source=source)
            for source in ("local_compute", "local_cache_hit", "external_kv_transfer")
        }
        raise AssertionError(f"{exc}; decode-0's prompt tokens by source: {sources}") from None


def test_pair_registers_as_handoff(mesh):
    engines = mesh.engines()
    for iid in ("prefill-0", "decode-0"):
        instance = engines[iid].instance
        assert instance.kv_connector == "ExampleConnector" and instance.dispatch_capability == 2  # HANDOFF


def test_launched_pair_moves_kv_from_prefill_to_decode(mesh):
    """The agent's kv_transfer_config (kv_producer / kv_consumer, one shared directory) makes a working pair: the
    prefill engine saves the prompt's KV, the decode engine loads it (RECIPES.md's CPU P/D recipe).

    The prompt is token ids of a fixed length: vLLM's ExampleConnector (0.32, `example_connector.py`) saves the
    first `(n - 1) // block_size * block_size` tokens of an n-token prompt but looks up `(n - 2) // block_size *
    block_size` of the same prompt, so a text prompt that the locally trained tiny tokenizer happens to turn into
    n = 1 (mod 32) tokens is never found (seen: 161 tokens). 150 tokens: both sides use the first 128."""
    prompt = [10 + (i * 7) % 400 for i in range(150)]
    before = external_tokens(mesh, "decode-0")
    for iid, max_tokens in (("prefill-0", 1), ("decode-0", 8)):
        body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens}
        reply = httpx.post(f"http://{mesh.engine_address(iid)}/v1/completions", json=body, timeout=180)
        assert reply.status_code == 200, reply.text
    wait_loaded(mesh, before)


def test_pd_pair_answers_through_envoy(mesh):
    before = external_tokens(mesh, "decode-0")
    # A prompt no engine has cached yet (the decode engine would otherwise reuse its own prefix cache).
    reply = httpx.post(
        mesh.http + "/v1/completions",
        json={"model": MODEL_NAME, "prompt": "Through Envoy. " + PROMPT, "max_tokens": 8},
        timeout=180,
    )
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] == 8
    wait_loaded(mesh, before)

"""The load signal from real vLLM: its prompt-token counter grows by exactly what the coordinator commits for each
request (the prompt length as the coordinator tokenized it), and the ledger takes prefill off while a stream still
decodes."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from coordinator.understanding import understand
from tandem.tokenizer import load_tokenizer
from tandem.v1 import admin_pb2, admin_pb2_grpc
from tests.helpers import wait_until
from tests.vllm.conftest import MODEL, MODEL_NAME, real_mesh, start


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("signal")
    running = start(real_mesh([("vllm-0", "hybrid", None)], workdir), workdir)
    yield running
    assert running.stop() == 0


def counters(mesh) -> tuple[int, int]:
    """The engine's (`vllm:prompt_tokens_total`, `vllm:generation_tokens_total`), summed over its ranks."""
    text = httpx.get(f"http://{mesh.engine_address('vllm-0')}/metrics", timeout=10).text
    prompt = generation = 0
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "vllm:prompt_tokens_total":
                prompt += int(s.value)
            elif s.name == "vllm:generation_tokens_total":
                generation += int(s.value)
    return prompt, generation


def predicted(body: dict) -> int:
    """What the coordinator commits to the prompt counter for this body: its own tokenization, times choices."""
    request = understand("completions", body, load_tokenizer(MODEL), 16)
    return request.prompt_tokens * request.n


def test_prompt_counter_grows_by_what_the_coordinator_predicts(mesh):
    bodies = [
        {"model": MODEL_NAME, "prompt": "The quick brown fox jumps over the lazy dog. " * k, "max_tokens": 3}
        for k in (2, 5, 9)
    ] + [
        {"model": MODEL_NAME, "prompt": "Two answers to one question, please. " * 4, "max_tokens": 2, "n": 2}
    ]
    for body in bodies:
        before = counters(mesh)
        reply = httpx.post(mesh.http + "/v1/completions", json=body, timeout=120)
        assert reply.status_code == 200, reply.text
        after = counters(mesh)
        assert after[0] - before[0] == predicted(body)
        assert after[1] - before[1] == reply.json()["usage"]["completion_tokens"]


def test_ledger_takes_prefill_off_while_the_stream_decodes(mesh):
    body = {
        "model": MODEL_NAME,
        "prompt": "Explain Envoy's ext_proc filter. " * 20,
        # Long enough to still be decoding after a few progress reports (4 Hz) on a fast CPU; a random tiny model
        # may otherwise stop at an end-of-sequence token early.
        "max_tokens": 1500,
        "ignore_eos": True,
        "stream": True,
    }
    # One channel for every poll: the CPU engine decoding on every core can starve a fresh TLS handshake.
    with mesh.channel() as channel:
        admin = admin_pb2_grpc.AdminStub(channel)
        with httpx.stream("POST", mesh.http + "/v1/completions", json=body, timeout=120) as reply:
            lines = reply.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            seen = wait_until(
                lambda: (s := stats(admin)).inflight_requests == 1 and s.prefill_tokens == 0 and s,
                60,
                "prefill off the ledger while the stream runs",
            )
            rest = [line for line in lines if line.startswith("data: ")]
        assert seen and rest[-1] == "data: [DONE]"
        final = wait_until(
            lambda: (s := stats(admin)).inflight_requests == 0 and s, 30, "the request released"
        )
    assert (final.prefill_tokens, final.decode_tokens) == (0, 0)


def stats(admin: admin_pb2_grpc.AdminStub) -> admin_pb2.InstanceWorkload:
    (only,) = admin.GetStats(admin_pb2.GetStatsRequest(), timeout=20).instances
    return only

"""vLLM 0.32's wire details simengine reproduces (tests/vllm/test_conformance.py checks them against the real one):
request-id headers, budgets of over-long requests, pydantic's lax types, logprobs / echo / continuous usage shapes,
FastAPI's 404/405 bodies, /version and /kv_event_sources."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

FAST = ("--speedup", "1000", "--max-model-len", "256")


@pytest.fixture(scope="module")
def with_ids():
    from tests.simengine.conftest import EngineProc

    engine = EngineProc(*FAST, "--enable-request-id-headers")
    yield engine
    engine.stop()


def raw(engine, path: str, body: dict | None = None, headers: dict | None = None, method: str | None = None):
    """(status, headers, decoded body or text) of any request."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(engine.url + path, data=data, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})  # fmt: skip
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            status, hdrs, text = r.status, r.headers, r.read().decode()
    except urllib.error.HTTPError as e:
        status, hdrs, text = e.code, e.headers, e.read().decode()
    try:
        return status, hdrs, json.loads(text)
    except json.JSONDecodeError:
        return status, hdrs, text


def test_request_id_header_on_every_response_only_when_enabled(engine, with_ids):
    body = {"prompt": "hi", "max_tokens": 2}
    for path, payload, method in (("/v1/completions", body, None), ("/v1/completions", {"max_tokens": 0}, None),
                                  ("/nope", None, "GET"), ("/health", None, "GET")):  # fmt: skip
        status, headers, _ = raw(with_ids, path, payload, {"X-Request-Id": "given"}, method)
        assert headers["X-Request-Id"] == "given", (path, status)
        assert len(raw(with_ids, path, payload, method=method)[1]["X-Request-Id"]) == 32  # a new id
        assert "X-Request-Id" not in raw(engine, path, payload, {"X-Request-Id": "given"}, method)[1]
    stream = urllib.request.Request(with_ids.url + "/v1/completions", data=json.dumps({**body, "stream": True}).encode(),
                                    headers={"Content-Type": "application/json", "X-Request-Id": "s1"})  # fmt: skip
    with urllib.request.urlopen(stream, timeout=10) as r:
        assert r.headers["X-Request-Id"] == "s1" and b"cmpl-s1" in r.read()


def test_over_long_requests_are_cut_to_the_context(with_ids):
    prompt = list(range(300, 500))  # 200 of 256 tokens
    status, _, body = raw(
        with_ids, "/v1/completions", {"prompt": prompt, "max_tokens": 100, "ignore_eos": True}
    )
    assert status == 200 and body["usage"]["completion_tokens"] == 56
    assert body["choices"][0]["finish_reason"] == "length"
    for payload, param in (({"prompt": prompt, "max_tokens": 300}, "max_tokens"),
                           ({"prompt": list(range(300, 560))}, "input_tokens"),
                           ({"prompt": list(range(300, 556))}, "max_tokens")):  # fmt: skip
        status, _, body = raw(with_ids, "/v1/completions", payload)
        assert status == 400 and body["error"]["param"] == param, body


def test_strings_and_numbers_are_converted_as_pydantic_does(with_ids):
    payload = {"prompt": "lax", "max_tokens": "3", "ignore_eos": "yes", "n": 2.0, "temperature": "0.5"}
    status, _, body = raw(with_ids, "/v1/completions", payload)
    assert status == 200 and body["usage"]["completion_tokens"] == 6
    status, _, body = raw(with_ids, "/v1/completions", {"prompt": "lax", "max_tokens": "three"})
    assert (
        status == 400
        and body["error"]["type"] == "Bad Request"
        and body["error"]["param"] == "body.max_tokens"
    )
    assert "int_parsing" in body["error"]["message"]


def test_logprobs_echo_and_continuous_usage_shapes(with_ids):
    status, _, body = raw(with_ids, "/v1/completions", {"prompt": [300, 301, 302], "max_tokens": 3, "logprobs": 2,
                                                       "echo": True, "ignore_eos": True})  # fmt: skip
    choice = body["choices"][0]
    lp = choice["logprobs"]
    assert status == 200 and len(lp["tokens"]) == 6 and lp["token_logprobs"][0] is None
    assert lp["top_logprobs"][0] is None and all(len(t) == 3 for t in lp["top_logprobs"][1:])
    assert lp["text_offset"] == sorted(lp["text_offset"]) and choice["text"] == "".join(lp["tokens"])
    assert choice["prompt_logprobs"][0] is None and len(choice["prompt_logprobs"]) == 3
    status, _, chat = raw(with_ids, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                                            "max_tokens": 2, "logprobs": True, "top_logprobs": 2})  # fmt: skip
    content = chat["choices"][0]["logprobs"]["content"]
    assert len(content) == 2 and all(
        len(c["top_logprobs"]) == 2 and isinstance(c["bytes"], list) for c in content
    )
    events = with_ids.stream("/v1/completions", {"prompt": "u", "max_tokens": 3, "ignore_eos": True,
                                                 "stream_options": {"include_usage": True, "continuous_usage_stats": True}})  # fmt: skip
    chunks = [json.loads(e) for e in events[:-1]]
    assert [c["usage"]["completion_tokens"] for c in chunks[:-1]] == [1, 2, 3] and chunks[-1]["choices"] == []
    assert "system_fingerprint" in chunks[-1] and "system_fingerprint" not in chunks[-2]


def test_framework_errors_version_and_event_sources(with_ids, tmp_path, engines):
    status, headers, body = raw(with_ids, "/nope", method="GET")
    assert status == 404 and body == {"detail": "Not Found"}
    status, headers, body = raw(with_ids, "/v1/completions", method="GET")
    assert status == 405 and body == {"detail": "Method Not Allowed"} and headers["Allow"] == "POST"
    assert raw(with_ids, "/version", method="GET")[2] == {"version": "0.32.0"}
    assert raw(with_ids, "/kv_event_sources", method="GET")[2] == {}
    cfg = {"enable_kv_cache_events": True, "endpoint": f"ipc://{tmp_path}/e.pub", "topic": "kv"}
    e = engines("--speedup", "1000", "--kv-events-config", json.dumps(cfg))
    sources = raw(e, "/kv_event_sources", method="GET")[2]
    assert sources["0"]["endpoint"] == cfg["endpoint"] and sources["0"]["publisher"] == "zmq"

"""Fault knobs: crash, hang, latency, error rate."""

import json
import socket
import urllib.error
import urllib.request

import pytest


def test_crash_after_n_requests(engines):
    e = engines("--speedup", "1000", "--fault-crash-after", "2")
    for _ in range(2):
        assert e.post("/v1/completions", {"prompt": "x", "max_tokens": 1})[0] == 200
    with pytest.raises((urllib.error.URLError, ConnectionError, OSError)):
        e.post("/v1/completions", {"prompt": "x", "max_tokens": 1}, timeout=5)
    assert e.proc.wait(5) == 1


def test_error_rate_answers_500(engines):
    e = engines("--speedup", "1000", "--fault-error-rate", "1.0")
    status, body = e.post("/v1/completions", {"prompt": "x", "max_tokens": 1})
    assert status == 500 and body["error"]["type"] == "InternalServerError"
    assert e.get("/health")[0] == 200


def test_hang_keeps_health_but_never_answers(engines):
    e = engines("--fault-hang")
    assert e.get("/health")[0] == 200
    with pytest.raises((TimeoutError, socket.timeout, urllib.error.URLError)):
        e.post("/v1/completions", {"prompt": "x", "max_tokens": 1}, timeout=0.5)


def test_latency_knob_still_answers(engines):
    e = engines("--speedup", "1000", "--fault-latency-ms", "50")
    req = urllib.request.Request(
        e.url + "/v1/completions", data=json.dumps({"prompt": "x", "max_tokens": 2}).encode()
    )
    with urllib.request.urlopen(req, timeout=5) as r:
        assert json.loads(r.read())["usage"]["completion_tokens"] == 2

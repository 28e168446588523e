"""Distributed tracing through a whole sim mesh (`tandem up` with `tracing` naming a small OTLP receiver): a request
sent with a W3C `traceparent` yields one trace whose spans cover Envoy, the coordinator (with the candidates'
scores), the conductor and the engine in the right parent/child order; the same for a P/D handoff and a trigger
request. Each mesh serves a handful of requests, each bounded by a deadline."""

from __future__ import annotations

import secrets

import httpx
import pytest

from tests.e2e.test_pd_trigger import trigger_config
from tests.helpers import OtlpReceiver, RunningMesh, mesh_config, wait_until

PROMPT = " ".join(f"token{i}" for i in range(120))


def aggregated() -> dict:
    return mesh_config(engines=2, engine_args=["--speedup", "20"], policy="kv_affinity")


def handoff() -> dict:
    config = mesh_config(engines=2, engine_args=["--speedup", "20"], policy="kv_affinity")
    roles = [("prefill-0", "prefill"), ("decode-0", "decode")]
    for engine, (iid, role) in zip(config["node_agents"][0]["engines"], roles, strict=True):
        engine.update(instance_id=iid, role=role, kv_connector="NixlConnector")
    config["coordinator"]["pd_mode"] = "prefill_handoff_decode"
    return config


def trigger() -> dict:
    config = trigger_config()
    for engine in config["node_agents"][0]["engines"]:  # no injected faults here
        engine["args"] = [a for a in engine["args"] if not a.startswith("--fault")]
        if "1500" in engine["args"]:
            engine["args"].remove("1500")
    return config


@pytest.fixture(scope="module")
def receiver():
    running = OtlpReceiver().start()
    yield running
    running.stop()


@pytest.fixture(scope="module", params=["aggregated", "handoff", "trigger"])
def mesh(request, receiver, tmp_path_factory):
    config = {"aggregated": aggregated, "handoff": handoff, "trigger": trigger}[request.param]()
    config["tracing"] = {"otlp_endpoint": receiver.address, "sample_ratio": 1.0}
    running = RunningMesh(config, tmp_path_factory.mktemp(f"traced-{request.param}"))
    running.start()
    running.kind = request.param
    yield running
    running.stop()


def by_id(spans):
    return {s["span_id"]: s for s in spans}


def ancestors(span, spans):
    """The services and names from `span` up to the trace's root."""
    index = by_id(spans)
    chain = []
    while span is not None:
        chain.append((span["service"], span["name"]))
        span = index.get(span["parent_id"])
    return chain


def one(spans, service, name):
    found = [s for s in spans if s["service"] == service and s["name"] == name]
    assert found, f"no {service} span {name!r} in {[(s['service'], s['name']) for s in spans]}"
    return found[0]


def test_a_traced_request_is_one_trace_across_envoy_coordinator_conductor_and_engine(mesh, receiver):
    trace_id = secrets.token_hex(16)
    parent = secrets.token_hex(8)
    reply = httpx.post(
        mesh.http + "/v1/completions",
        json={"model": "tandem-sim", "prompt": PROMPT, "max_tokens": 8},
        headers={"traceparent": f"00-{trace_id}-{parent}-01"},
        timeout=30,
    )
    assert reply.status_code == 200, reply.text
    wanted = {"envoy", "tandem-coordinator", "tandem-conductor", "simengine"}
    if mesh.kind == "trigger":
        wanted_rpc = "rpc /tandem.v1.Metaserver/Trigger"
    wait_until(
        lambda: (
            wanted <= {s["service"] for s in receiver.trace(trace_id)}
            and (mesh.kind != "trigger" or any(s["name"] == wanted_rpc for s in receiver.trace(trace_id)))
            and (
                mesh.kind != "handoff"
                or sum(s["name"] == "llm_request" for s in receiver.trace(trace_id)) == 2
            )
        ),
        timeout=20,
        what="spans of every process",
    )
    spans = receiver.trace(trace_id)
    index = by_id(spans)
    # Envoy continued the client's trace: its ingress span's parent is the client's span.
    ingress = [s for s in spans if s["service"] == "envoy" and s["parent_id"] == parent]
    assert ingress, [(s["service"], s["name"], s["parent_id"]) for s in spans if s["service"] == "envoy"]
    route = one(spans, "tandem-coordinator", "tandem.route")
    assert index[route["parent_id"]]["service"] == "envoy"  # the decision call's span
    for child in ("tandem.understand", "tandem.pick"):
        assert index[one(spans, "tandem-coordinator", child)["parent_id"]] is route
    score = one(spans, "tandem-coordinator", "tandem.score")
    assert score["attributes"]["tandem.chosen"]
    assert any(k.endswith(".predicted_ttft_s") for k in score["attributes"])
    assert any(k.endswith(".matched_npu_tokens") for k in score["attributes"])
    one(spans, "tandem-conductor", "conductor.match")
    for match in (s for s in spans if s["name"] == "conductor.match"):  # the decision's, and a callback's
        assert index[match["parent_id"]]["name"] == "tandem.conductor_match"
        assert ancestors(match, spans)[-1] == ("envoy", "ingress")
    engines = [s for s in spans if s["service"] == "simengine" and s["name"] == "llm_request"]
    # The engine that serves the answer is a child of Envoy's request (Envoy sent it `traceparent`).
    served = [s for s in engines if index.get(s["parent_id"], {}).get("service") == "envoy"]
    assert served and ancestors(served[0], spans)[-1][0] == "envoy"
    if mesh.kind == "handoff":
        leg = one(spans, "tandem-coordinator", "tandem.prefill_leg")
        assert any(s["parent_id"] == leg["span_id"] for s in engines)  # the prefill engine's span
    if mesh.kind == "trigger":
        callback = one(spans, "tandem-coordinator", wanted_rpc)
        assert ("simengine", "llm_request") in ancestors(callback, spans)  # the decode engine's callback


def test_untraced_requests_are_sampled_by_ratio(mesh, receiver):
    """At ratio 1 a request without `traceparent` starts a trace at Envoy that reaches the engine."""
    before = {s["trace_id"] for s in list(receiver.spans)}
    reply = httpx.post(
        mesh.http + "/v1/completions",
        json={"model": "tandem-sim", "prompt": "fresh trace", "max_tokens": 4},
        timeout=30,
    )
    assert reply.status_code == 200

    def new_trace():
        fresh = {s["trace_id"] for s in list(receiver.spans)} - before
        for trace_id in fresh:
            services = {s["service"] for s in receiver.trace(trace_id)}
            if {"envoy", "tandem-coordinator", "simengine"} <= services:
                return True
        return False

    wait_until(new_trace, timeout=20, what="a new trace from Envoy to the engine")

"""`bench.envoy_cost`: each variant takes out exactly its part of the configuration `tandem up` renders."""

import argparse
import tempfile
from pathlib import Path

import pytest
import yaml

from bench.envoy_cost import UPSTREAM_HEADER, VARIANTS, PathStats, Row, _ingress, table, variant
from bench.harness import mesh_config
from mesh.config import parse_mesh_config
from mesh.envoy import write_envoy_config
from tandem.protogen import DESCRIPTOR

UPSTREAMS = {"engines": ["127.0.0.1:8001", "127.0.0.1:8002"], "null": ["127.0.0.1:9001"]}


@pytest.fixture(scope="module")
def rendered() -> dict:
    config = mesh_config(engines=2)
    config["security"] = {"insecure": True}
    path = write_envoy_config(parse_mesh_config(config), DESCRIPTOR, Path(tempfile.mkdtemp()) / "envoy.yaml")
    return yaml.safe_load(path.read_text())


def parts(config: dict) -> dict:
    listener, hcm = _ingress(config)
    authz = [f for f in hcm["http_filters"] if f["name"] == "envoy.filters.http.ext_authz"]
    clusters = {c["name"]: c for c in config["static_resources"]["clusters"]}
    return {
        "access log": "access_log" in hcm,
        "overload manager": "overload_manager" in config,
        "connection limit": len(listener["filter_chains"][0]["filters"]) > 1,
        "listener filters": "listener_filters" in listener,
        "local replies": "local_reply_config" in hcm,
        "decision": bool(authz),
        "decision retry": bool(authz) and "retry_policy" in authz[0]["typed_config"]["grpc_service"],
        "original_dst": any(r["route"]["cluster"] == "engines" for r in _routes(hcm)),
        "static clusters": {"bench_engines", "bench_null"} <= set(clusters),
    }


def _routes(hcm: dict) -> list[dict]:
    return [r for vh in hcm["route_config"]["virtual_hosts"] for r in vh["routes"] if "route" in r]


def test_the_mesh_variant_is_the_rendered_configuration(rendered):
    assert variant(rendered, "mesh", UPSTREAMS) == rendered
    assert parts(rendered) == {**{k: True for k in parts(rendered)}, "static clusters": False}


@pytest.mark.parametrize(
    ("name", "removed", "added"),
    [
        ("no access log", {"access log"}, set()),
        ("no guards", {"overload manager", "connection limit", "listener filters", "local replies"}, set()),
        ("no decision retry", {"decision retry"}, set()),
        ("decision, static route", {"original_dst"}, {"static clusters"}),
        ("no decision", {"decision", "decision retry", "original_dst"}, {"static clusters"}),
        ("plain proxy", "all", {"static clusters"}),
    ],
)
def test_each_variant_takes_out_its_part_and_keeps_the_rest(rendered, name, removed, added):
    before, after = parts(rendered), parts(variant(rendered, name, UPSTREAMS))
    if removed == "all":  # plain proxy: every part taken out
        removed = {k for k in before if k != "static clusters"}
    assert {k for k in before if before[k] and not after[k]} == removed
    assert {k for k in after if after[k] and not before[k]} == added
    assert parts(rendered) == before  # the rendered configuration is left as it was


def test_without_a_decision_the_load_generators_header_picks_the_upstreams_cluster(rendered):
    _, hcm = _ingress(variant(rendered, "no decision", UPSTREAMS))
    by_header = {
        r["match"]["headers"][0]["string_match"]["exact"]: r["route"]["cluster"] for r in _routes(hcm)
    }
    assert by_header == {"engines": "bench_engines", "null": "bench_null"}
    assert all(r["match"]["headers"][0]["name"] == UPSTREAM_HEADER for r in _routes(hcm))
    clusters = {
        c["name"]: c for c in variant(rendered, "no decision", UPSTREAMS)["static_resources"]["clusters"]
    }
    endpoints = clusters["bench_engines"]["load_assignment"]["endpoints"][0]["lb_endpoints"]
    assert [e["endpoint"]["address"]["socket_address"]["port_value"] for e in endpoints] == [8001, 8002]
    assert (
        clusters["bench_engines"]["type"] == "STATIC"
        and "original_dst_lb_config" not in clusters["bench_engines"]
    )


def test_an_unknown_variant_is_refused(rendered):
    with pytest.raises(ValueError, match="unknown variant 'no envoy'"):
        variant(rendered, "no envoy", UPSTREAMS)


def test_the_table_reports_each_parts_cost_as_a_difference_of_medians():
    def row(cpu: list[float]) -> Row:
        return Row(PathStats(latencies=[0.01] * 10, busy_s=1.0), cpu)

    rows = {
        (v, up): row([0.5, 0.6, 0.7] if v == "mesh" else [0.3, 0.3, 0.3])
        for v in VARIANTS
        for up in ("engines", "null")
    }
    args = argparse.Namespace(requests=30, rounds=3, rate=400.0, concurrency=32, engines=2, speedup=10.0,
                              max_tokens=16, envoy_version="1.40.0", load_start=0.5, load_end=0.6)  # fmt: skip
    text = table(rows, args)
    assert "| mesh | engines | 10 / 0 | 10 | 10.00 | 10.00 | 0.600 (0.500-0.700) |" in text
    assert "- the gRPC access log: engines +0.300, null +0.300" in text
    assert "400 per second (open loop)" in text

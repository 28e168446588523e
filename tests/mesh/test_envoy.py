"""The Envoy bootstrap rendered from envoy/envoy.yaml.j2: accepted by the real Envoy binary, keeps the routing
rules, and matches the reviewed golden rendering."""

import os
import subprocess
from pathlib import Path

import pytest

from mesh.certs import ensure_certs
from mesh.config import load_mesh_config, parse_mesh_config
from mesh.envoy import DESTINATION_HEADER, build_envoy_config, render_envoy_config, write_envoy_config
from mesh.up import envoy_binary
from tandem.protogen import DESCRIPTOR

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = Path(__file__).parent / "golden" / "envoy-default.yaml"
MESH_FILES = [
    "configs/default.yaml",
    *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "examples").glob("*.yaml")),
]


def test_golden_rendering():
    """The default mesh renders to the reviewed file, comments included (`TANDEM_UPDATE_GOLDEN=1` rewrites it after
    a deliberate template change; review the diff)."""
    rendered = render_envoy_config(
        load_mesh_config("configs/default.yaml"), Path("build/tandem_descriptor.pb")
    )
    if os.environ.get("TANDEM_UPDATE_GOLDEN") == "1":
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(rendered)
    assert rendered == GOLDEN.read_text(), (
        "template changed: rerun with TANDEM_UPDATE_GOLDEN=1 and review the diff"
    )
    assert "# --- ingress: the OpenAI API" in rendered  # the comments survive rendering


@pytest.mark.parametrize("mesh_file", MESH_FILES)
def test_real_envoy_validates_every_shipped_mesh(mesh_file, tmp_path):
    mesh = load_mesh_config(ROOT / mesh_file)
    ensure_certs(tmp_path / "certs", mesh)
    path = write_envoy_config(mesh, DESCRIPTOR, tmp_path / "envoy.yaml", tmp_path / "certs")
    result = subprocess.run(
        [envoy_binary(), "--mode", "validate", "-c", str(path)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr[-2000:]


def _ingress(mesh):
    config = build_envoy_config(mesh, DESCRIPTOR)
    return hcm_of(config["static_resources"]["listeners"][0]), config["static_resources"]["clusters"][0]


def test_aggregated_mesh_decides_with_ext_authz_and_never_forwards_unrouted_requests():
    mesh = load_mesh_config("configs/default.yaml")
    assert mesh.decision_path == "ext_authz"
    hcm, engines = _ingress(mesh)
    authz = hcm["http_filters"][0]["typed_config"]
    assert authz["failure_mode_allow"] is False and authz["with_request_body"]["pack_as_bytes"] is True
    routes = hcm["route_config"]["virtual_hosts"][0]["routes"]
    assert routes[0]["match"]["headers"][0]["name"] == DESTINATION_HEADER
    assert routes[-1]["direct_response"]["status"] == 503
    assert engines["original_dst_lb_config"]["http_header_name"] == DESTINATION_HEADER
    assert hcm["access_log"][0]["name"] == "envoy.access_loggers.http_grpc"  # how requests end


def test_decision_calls_and_the_access_log_reach_the_coordinator_over_mutual_tls():
    """ext_authz, ext_proc and the access log all use the `coordinator` cluster: Envoy presents its certificate and
    accepts only the coordinator's (the coordinator allows these services to Envoy's identity only)."""
    for raw in ({}, {"coordinator": {"pd_mode": "concurrent_engine_sync"}}):
        mesh = parse_mesh_config(raw)
        hcm, _ = _ingress(mesh)
        services = [hcm["access_log"][0]["typed_config"]["common_config"]["grpc_service"]]
        services.append(hcm["http_filters"][0]["typed_config"]["grpc_service"])
        assert {s["envoy_grpc"]["cluster_name"] for s in services} == {"coordinator"}
        clusters = build_envoy_config(mesh, DESCRIPTOR)["static_resources"]["clusters"]
        coordinator = next(c for c in clusters if c["name"] == "coordinator")
        tls = coordinator["transport_socket"]["typed_config"]["common_tls_context"]
        assert tls["tls_certificates"] and tls["validation_context"]["match_typed_subject_alt_names"] == [
            {"san_type": "URI", "matcher": {"exact": "spiffe://tandem/coordinator"}}
        ]


def test_pd_mesh_decides_with_one_ext_proc_body_message(tmp_path):
    mesh = parse_mesh_config({"coordinator": {"pd_mode": "concurrent_engine_sync"}})
    assert mesh.decision_path == "ext_proc"
    hcm, engines = _ingress(mesh)
    ext_proc = hcm["http_filters"][0]["typed_config"]
    assert ext_proc["failure_mode_allow"] is False
    mode = ext_proc["processing_mode"]
    assert (mode["request_header_mode"], mode["request_body_mode"]) == ("SKIP", "BUFFERED")
    assert mode["response_body_mode"] == "NONE"  # tokens never reach Python
    assert hcm["http_filters"][1]["name"] == "envoy.filters.http.buffer"  # routing waits for the decision
    assert engines["original_dst_lb_config"]["metadata_key"]["key"] == "tandem"
    # The key check needs the Authorization header, which the body message carries as an attribute.
    assert "request.headers['authorization']" in ext_proc["request_attributes"]
    routed = [r for r in hcm["route_config"]["virtual_hosts"][0]["routes"] if "route" in r]
    for route in routed:  # the engine gets the minted id, the client its own back
        assert {h["header"]["key"] for h in route["request_headers_to_add"]} == {
            "x-request-id",
            "x-tandem-client-request-id",
        }
        assert route["response_headers_to_add"][0]["header"]["key"] == "x-request-id"
        assert "request_headers_to_remove" not in route  # no API keys: an engine may have its own
    keyed = parse_mesh_config({"coordinator": {"pd_mode": "concurrent_engine_sync", "api_keys_env": "KEYS"}})
    keyed_routes = _ingress(keyed)[0]["route_config"]["virtual_hosts"][0]["routes"]
    assert [r["request_headers_to_remove"] for r in keyed_routes if "route" in r] == [["authorization"]] * 2
    ensure_certs(tmp_path / "certs", mesh)
    path = write_envoy_config(mesh, DESCRIPTOR, tmp_path / "envoy.yaml", tmp_path / "certs")
    result = subprocess.run(
        [envoy_binary(), "--mode", "validate", "-c", str(path)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr[-2000:]


def hcm_of(listener: dict) -> dict:
    """The HTTP connection manager of a listener."""
    filters = listener["filter_chains"][0]["filters"]
    return next(f for f in filters if f["name"].endswith("http_connection_manager"))["typed_config"]


def test_ipv6_listeners(tmp_path):
    mesh = parse_mesh_config(
        {"envoy": {"http_listen": "[::1]:8000", "grpc_listen": "[::1]:9000", "callback_listen": "[::1]:9002"}}
    )
    ensure_certs(tmp_path / "certs", mesh)
    listeners = build_envoy_config(mesh, DESCRIPTOR)["static_resources"]["listeners"]
    assert listeners[0]["address"]["socket_address"] == {"address": "::1", "port_value": 8000}
    path = write_envoy_config(mesh, DESCRIPTOR, tmp_path / "envoy.yaml", tmp_path / "certs")
    result = subprocess.run(
        [envoy_binary(), "--mode", "validate", "-c", str(path)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr[-2000:]

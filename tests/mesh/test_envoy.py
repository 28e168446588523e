"""The Envoy bootstrap rendered from envoy/envoy.yaml.j2: accepted by the real Envoy binary, keeps the routing
rules, and matches the reviewed golden rendering."""

import os
import subprocess
from pathlib import Path

import pytest

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
    path = write_envoy_config(load_mesh_config(ROOT / mesh_file), DESCRIPTOR, tmp_path / "envoy.yaml")
    result = subprocess.run(
        [envoy_binary(), "--mode", "validate", "-c", str(path)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr[-2000:]


def _ingress(mesh):
    config = build_envoy_config(mesh, DESCRIPTOR)
    hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    return hcm, config["static_resources"]["clusters"][0]


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
    path = write_envoy_config(mesh, DESCRIPTOR, tmp_path / "envoy.yaml")
    result = subprocess.run(
        [envoy_binary(), "--mode", "validate", "-c", str(path)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr[-2000:]


def test_ipv6_listeners(tmp_path):
    mesh = parse_mesh_config({"envoy": {"http_listen": "[::1]:8000", "grpc_listen": "[::1]:9000"}})
    listeners = build_envoy_config(mesh, DESCRIPTOR)["static_resources"]["listeners"]
    assert listeners[0]["address"]["socket_address"] == {"address": "::1", "port_value": 8000}
    path = write_envoy_config(mesh, DESCRIPTOR, tmp_path / "envoy.yaml")
    result = subprocess.run(
        [envoy_binary(), "--mode", "validate", "-c", str(path)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr[-2000:]

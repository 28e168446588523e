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


def test_ingress_never_forwards_unrouted_requests():
    config = build_envoy_config(load_mesh_config("configs/default.yaml"), DESCRIPTOR)
    ingress = config["static_resources"]["listeners"][0]
    hcm = hcm_of(ingress)
    ext_proc = hcm["http_filters"][0]["typed_config"]
    assert ext_proc["failure_mode_allow"] is False
    assert ext_proc["processing_mode"]["request_body_mode"] == "BUFFERED"
    assert ext_proc["processing_mode"]["response_body_mode"] == "NONE"  # tokens never reach Python
    routes = hcm["route_config"]["virtual_hosts"][0]["routes"]
    assert routes[0]["match"]["headers"][0]["name"] == DESTINATION_HEADER
    assert routes[-1]["direct_response"]["status"] == 503
    engines = config["static_resources"]["clusters"][0]
    assert engines["original_dst_lb_config"]["http_header_name"] == DESTINATION_HEADER


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

"""`tandem certs` and the security parts of the mesh file and of Envoy's bootstrap."""

import stat
from pathlib import Path

import pytest
from cryptography import x509

from mesh.certs import CertError, create_ca, default_ca_dir, ensure_certs
from mesh.cli import main
from mesh.config import parse_mesh_config
from mesh.envoy import build_envoy_config
from mesh.security import certs_dir, component_tls, engine_tls_env
from tandem.config_file import ConfigError
from tandem.protogen import DESCRIPTOR

MESH = {"node_agents": [{"node_id": "n1", "listen": "10.0.0.7:9300"}]}


def uris(path) -> list[str]:
    cert = x509.load_pem_x509_certificate(path.read_bytes())
    return cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(
        x509.UniformResourceIdentifier
    )


def test_certs_per_component_with_identities(tmp_path):
    written = ensure_certs(tmp_path, parse_mesh_config(MESH))
    assert sorted(written) == ["agent-n1", "conductor", "coordinator", "envoy", "operator"]
    assert uris(tmp_path / "agent-n1.pem") == ["spiffe://tandem/agent/n1"]
    assert uris(tmp_path / "operator.pem") == ["spiffe://tandem/operator"]
    for key in tmp_path.glob("*-key.pem"):
        assert stat.S_IMODE(key.stat().st_mode) == 0o600, key
    cert = x509.load_pem_x509_certificate((tmp_path / "agent-n1.pem").read_bytes())
    ips = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(
        x509.IPAddress
    )
    assert "10.0.0.7" in {str(ip) for ip in ips}  # the address in the mesh file
    assert (tmp_path / "ca-bundle.pem").read_text().endswith((tmp_path / "ca.pem").read_text())


def test_existing_files_are_kept_and_force_rotates_leaves(tmp_path):
    mesh = parse_mesh_config(MESH)
    ensure_certs(tmp_path, mesh)
    ca, leaf = (tmp_path / "ca.pem").read_bytes(), (tmp_path / "envoy.pem").read_bytes()
    assert ensure_certs(tmp_path, mesh) == []
    assert (tmp_path / "envoy.pem").read_bytes() == leaf
    assert len(ensure_certs(tmp_path, mesh, force=True)) == 5
    assert (tmp_path / "envoy.pem").read_bytes() != leaf and (tmp_path / "ca.pem").read_bytes() == ca


def test_bring_your_own_ca(tmp_path):
    certs, ca = tmp_path / "certs", tmp_path / "certs-ca"
    create_ca(certs, "Corporate CA")
    ensure_certs(certs, parse_mesh_config(MESH))
    issuer = x509.load_pem_x509_certificate((certs / "operator.pem").read_bytes()).issuer
    assert "Corporate CA" in issuer.rfc4514_string()
    (ca / "ca-key.pem").unlink()
    (certs / "envoy.pem").unlink()
    with pytest.raises(CertError, match="ca-key.pem"):
        ensure_certs(certs, parse_mesh_config(MESH))


def test_ca_key_is_kept_apart_from_the_component_keys(tmp_path):
    """The CA's key never sits in the directory components (and, through them, engines) are pointed at: it is in an
    owner-only directory of its own. A key left beside the certificates (the layout before) is moved there."""
    certs = tmp_path / "run" / "certs"
    ensure_certs(certs, parse_mesh_config(MESH))
    ca = default_ca_dir(certs)
    assert ca == tmp_path / "run" / "certs-ca"
    assert not (certs / "ca-key.pem").exists()
    assert (certs / "ca.pem").exists() and (
        certs / "operator-key.pem"
    ).exists()  # where the README shows them
    assert stat.S_IMODE(ca.stat().st_mode) == 0o700
    assert stat.S_IMODE((ca / "ca-key.pem").stat().st_mode) == 0o600
    # The layout before: the key beside the certificates is moved out, and rotation still works from it.
    (ca / "ca-key.pem").rename(certs / "ca-key.pem")
    assert len(ensure_certs(certs, parse_mesh_config(MESH), force=True)) == 5
    assert not (certs / "ca-key.pem").exists() and (ca / "ca-key.pem").exists()
    # Two keys: which is the CA's is not guessed.
    (certs / "ca-key.pem").write_bytes((ca / "ca-key.pem").read_bytes())
    with pytest.raises(CertError, match="remove the one not in use"):
        ensure_certs(certs, parse_mesh_config(MESH))
    (certs / "ca-key.pem").unlink()
    # A key that is not the CA certificate's is refused, not used to issue certificates nobody trusts.
    other = tmp_path / "other"
    create_ca(other, ca_dir=ca / "x")
    (ca / "x" / "ca-key.pem").replace(ca / "ca-key.pem")
    with pytest.raises(CertError, match="not the key of"):
        ensure_certs(certs, parse_mesh_config(MESH), force=True)


def test_cli(tmp_path, capsys):
    config = tmp_path / "mesh.yaml"
    config.write_text("node_agents: [{node_id: n1}]\n")
    assert main(["certs", "--config", str(config), "--dir", str(tmp_path / "c")]) == 0
    out = capsys.readouterr().out
    assert "spiffe://tandem/agent/n1" in out and str(tmp_path / "c-ca") in out
    assert (tmp_path / "c-ca" / "ca-key.pem").exists() and not (tmp_path / "c" / "ca-key.pem").exists()
    args = [
        "certs",
        "--config",
        str(config),
        "--dir",
        str(tmp_path / "d"),
        "--ca-dir",
        str(tmp_path / "vault"),
    ]
    assert main(args) == 0
    assert (tmp_path / "vault" / "ca-key.pem").exists()


def test_which_certificates_a_component_uses(tmp_path, monkeypatch):
    monkeypatch.delenv("TANDEM_CERTS_DIR", raising=False)
    secure = parse_mesh_config({}, str(tmp_path / "mesh.yaml"))
    with pytest.raises(ConfigError, match="security.certs_dir"):
        certs_dir(secure)
    assert parse_mesh_config({"security": {"insecure": True}}).security.insecure
    assert component_tls(parse_mesh_config({"security": {"insecure": True}}), "coordinator") is None
    relative = parse_mesh_config({"security": {"certs_dir": "pki"}}, str(tmp_path / "mesh.yaml"))
    assert certs_dir(relative) == tmp_path / "pki"
    monkeypatch.setenv("TANDEM_CERTS_DIR", str(tmp_path / "env"))
    assert certs_dir(relative) == tmp_path / "env" and str(certs_dir(relative, "/x")) == "/x"
    ensure_certs(tmp_path / "env", relative)
    assert component_tls(relative, "coordinator").cert == tmp_path / "env" / "coordinator.pem"
    assert engine_tls_env(relative)["SSL_CERT_FILE"].endswith("ca-bundle.pem")
    # What the agent gives its engines: a copy of the bundle in its runtime directory, no path into the certificates.
    env = engine_tls_env(relative, into=tmp_path / "runtime")
    assert env == {
        k: str(tmp_path / "runtime" / "ca-bundle.pem") for k in ("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE")
    }
    assert (tmp_path / "runtime" / "ca-bundle.pem").read_text() == (
        tmp_path / "env" / "ca-bundle.pem"
    ).read_text()


def test_admin_interface_is_a_unix_socket_only():
    """No TCP admin port at all, not even on loopback (any local process could stop Envoy): an old mesh file that
    names one is refused with the key, and the bootstrap has an owner-only unix socket."""
    for address in ("0.0.0.0:9901", "127.0.0.1:9901"):
        with pytest.raises(ConfigError, match="envoy.admin_listen: .*unix socket"):
            parse_mesh_config({"envoy": {"admin_listen": address}})
    with pytest.raises(ConfigError, match="envoy.admin_socket: .*100 bytes"):
        parse_mesh_config({"envoy": {"admin_socket": "/" + "x" * 120}})
    mesh = parse_mesh_config({"security": {"insecure": True}})
    admin = build_envoy_config(mesh, DESCRIPTOR, admin_socket=Path("/srv/run/envoy-admin.sock"))["admin"]
    assert admin["address"] == {"pipe": {"path": "/srv/run/envoy-admin.sock", "mode": 0o600}}


def listener(config: dict, name: str) -> dict:
    return next(x for x in config["static_resources"]["listeners"] if x["name"] == name)


def hcm(lst: dict) -> dict:
    return next(f for f in lst["filter_chains"][0]["filters"] if f["name"].endswith("connection_manager"))[
        "typed_config"
    ]


def test_envoy_listeners_secure_by_default(tmp_path):
    config = build_envoy_config(parse_mesh_config(MESH), DESCRIPTOR, tmp_path)
    control = listener(config, "control")
    tls_context = control["filter_chains"][0]["transport_socket"]["typed_config"]
    assert tls_context["require_client_certificate"] is True
    filters = [f["name"] for f in hcm(control)["http_filters"]]
    assert filters == ["envoy.filters.http.rbac", "envoy.filters.http.router"]
    routes = [r["match"]["prefix"] for r in hcm(control)["route_config"]["virtual_hosts"][0]["routes"]]
    assert "/" not in routes and not any(
        "ext_proc" in r for r in routes
    )  # nothing else reaches the coordinator
    callback = listener(config, "callback")
    callback_routes = hcm(callback)["route_config"]["virtual_hosts"][0]["routes"]
    assert callback_routes[0]["match"]["prefix"] == "/tandem.v1.Metaserver/"
    assert callback_routes[-1]["direct_response"]["status"] == 404
    clusters = {c["name"]: c for c in config["static_resources"]["clusters"]}
    upstream = clusters["coordinator"]["transport_socket"]["typed_config"]["common_tls_context"]
    san = upstream["validation_context"]["match_typed_subject_alt_names"][0]
    assert san["matcher"]["exact"] == "spiffe://tandem/coordinator"
    assert "overload_manager" in config


def test_insecure_mode_renders_plain_text():
    mesh = parse_mesh_config({**MESH, "security": {"insecure": True}})
    config = build_envoy_config(mesh, DESCRIPTOR)
    assert "transport_socket" not in listener(config, "control")["filter_chains"][0]
    assert mesh.metaserver_url.startswith("http://")
    assert parse_mesh_config(MESH).metaserver_url.startswith("https://")

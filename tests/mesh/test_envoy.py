"""The Envoy bootstrap rendered from envoy/envoy.yaml.j2: accepted by the real Envoy binary, keeps the routing
rules, and matches the reviewed golden rendering."""

import os
import re
import subprocess
from pathlib import Path

import httpx
import pytest
import yaml
from cryptography import x509

from mesh.certs import ensure_certs
from mesh.config import ModelConfig, load_mesh_config, parse_mesh_config
from mesh.envoy import (
    DESTINATION_HEADER,
    admin_get,
    build_envoy_config,
    render_envoy_config,
    write_envoy_config,
)
from mesh.up import envoy_binary
from tandem.protogen import DESCRIPTOR
from tests.helpers import assert_envoy_accepts, free_ports, wait_until

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
    assert_envoy_accepts(mesh, tmp_path)


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
    assert_envoy_accepts(mesh, tmp_path)


def hcm_of(listener: dict) -> dict:
    """The HTTP connection manager of a listener."""
    filters = listener["filter_chains"][0]["filters"]
    return next(f for f in filters if f["name"].endswith("http_connection_manager"))["typed_config"]


def test_ipv6_listeners(tmp_path):
    mesh = parse_mesh_config(
        {"envoy": {"http_listen": "[::1]:8000", "grpc_listen": "[::1]:9000", "callback_listen": "[::1]:9002"}}
    )
    listeners = build_envoy_config(mesh, DESCRIPTOR)["static_resources"]["listeners"]
    assert listeners[0]["address"]["socket_address"] == {"address": "::1", "port_value": 8000}
    assert_envoy_accepts(mesh, tmp_path)


def test_engines_route_has_an_idle_timeout_and_retries_once_before_any_byte():
    mesh = parse_mesh_config({"envoy": {"upstream_idle_timeout_s": 7}})
    config = build_envoy_config(mesh, DESCRIPTOR)
    hcm = hcm_of(config["static_resources"]["listeners"][0])
    route = hcm["route_config"]["virtual_hosts"][0]["routes"][0]["route"]
    assert route["idle_timeout"] == "7s" and route["timeout"] == "0s"
    assert route["retry_policy"] == {"retry_on": "connect-failure,refused-stream,reset", "num_retries": 1}


def test_static_engines_cluster_lists_the_engines_and_validates(tmp_path):
    mesh = load_mesh_config(ROOT / "configs/default.yaml").model_copy(deep=True)
    mesh.envoy.engines_cluster = "static"
    config = build_envoy_config(mesh, DESCRIPTOR)
    engines = config["static_resources"]["clusters"][0]
    endpoints = [
        e["endpoint"]["address"]["socket_address"]
        for e in engines["load_assignment"]["endpoints"][0]["lb_endpoints"]
    ]
    wanted = sorted((e.host, e.port) for a in mesh.node_agents for e in a.engines)
    assert sorted((e["address"], e["port_value"]) for e in endpoints) == wanted
    policy = engines["load_balancing_policy"]["policies"][0]["typed_extension_config"]["typed_config"]
    assert policy["override_host_sources"] == [{"header": DESTINATION_HEADER}]
    assert engines["outlier_detection"]["split_external_local_origin_errors"] is True
    assert_envoy_accepts(mesh, tmp_path)


def test_coordinator_replicas_are_one_health_checked_cluster(tmp_path):
    section = {"listen": "127.0.0.1:9100", "replicas": 2, "etcd": {"endpoint": "127.0.0.1:2379"}}
    mesh = parse_mesh_config({"coordinator": section})
    clusters = {c["name"]: c for c in build_envoy_config(mesh, DESCRIPTOR)["static_resources"]["clusters"]}
    coordinator = clusters["coordinator"]
    ports = [
        e["endpoint"]["address"]["socket_address"]["port_value"]
        for e in coordinator["load_assignment"]["endpoints"][0]["lb_endpoints"]
    ]
    assert ports == [9100, 9110] and "grpc_health_check" in coordinator["health_checks"][0]
    # Every replica cluster is mutual TLS with the coordinator's identity (decisions, access log, callbacks).
    for name in ("coordinator", "coordinator_c0", "coordinator_c1"):
        tls = clusters[name]["transport_socket"]["typed_config"]["common_tls_context"]
        assert tls["validation_context"]["match_typed_subject_alt_names"][0]["matcher"] == {
            "exact": "spiffe://tandem/coordinator"
        }
    # Each replica gets the access log of its own tickets (ids `c<i>.…`) and of requests without one.
    ingress = hcm_of(build_envoy_config(mesh, DESCRIPTOR)["static_resources"]["listeners"][0])
    for i, logger in enumerate(ingress["access_log"]):
        cluster = logger["typed_config"]["common_config"]["grpc_service"]["envoy_grpc"]["cluster_name"]
        own = logger["filter"]["metadata_filter"]
        assert cluster == f"coordinator_c{i}" and own["match_if_key_not_found"] is True
        assert own["matcher"]["filter"] == "envoy.filters.http.ext_authz"
        assert own["matcher"]["value"] == {"string_match": {"prefix": f"c{i}."}}
    # A Check that loses its replica is asked once more of another one; with one coordinator, again with a backoff
    # while it restarts (every retry allowed in flight).
    authz = ingress["http_filters"][0]
    retry = authz["typed_config"]["grpc_service"]["retry_policy"]
    assert retry["num_retries"] == 1 and "reset" in retry["retry_on"].split(",")
    assert retry["retry_host_predicate"][0]["name"] == "envoy.retry_host_predicates.previous_hosts"
    single = hcm_of(build_envoy_config(parse_mesh_config({}), DESCRIPTOR)["static_resources"]["listeners"][0])
    again = single["http_filters"][0]["typed_config"]["grpc_service"]["retry_policy"]
    # Envoy takes max_interval as the per-try timeout too: the decision timeout, so a slow decision is never cut.
    assert again["num_retries"] == 40 and again["retry_back_off"]["max_interval"] == "5s"
    assert "retry_host_predicate" not in again
    alone = build_envoy_config(parse_mesh_config({}), DESCRIPTOR)["static_resources"]["clusters"]
    breakers = next(c for c in alone if c["name"] == "coordinator")["circuit_breakers"]["thresholds"][0]
    assert breakers["max_retries"] == 100000
    # So is an ext_proc stream (P/D meshes) that loses its replica before the reply began.
    pd = parse_mesh_config({"coordinator": {**section, "pd_mode": "prefill_handoff_decode"}})
    ingress = hcm_of(build_envoy_config(pd, DESCRIPTOR)["static_resources"]["listeners"][0])
    ext_proc = ingress["http_filters"][0]
    assert ext_proc["name"] == "envoy.filters.http.ext_proc"
    assert ext_proc["typed_config"]["grpc_service"]["retry_policy"] == retry
    (tmp_path / "pd").mkdir()
    assert_envoy_accepts(pd, tmp_path / "pd")
    # A metaserver callback reaches the replica its URL names, on the callback listener only.
    listeners = {
        listener["name"]: listener
        for listener in build_envoy_config(mesh, DESCRIPTOR)["static_resources"]["listeners"]
    }
    routes = hcm_of(listeners["callback"])["route_config"]["virtual_hosts"][0]["routes"]
    by_replica = {
        r["match"]["headers"][0]["string_match"]["prefix"]: r["route"]["cluster"]
        for r in routes
        if "headers" in r["match"]
    }
    assert by_replica == {"/v1/metaserver/c0/": "coordinator_c0", "/v1/metaserver/c1/": "coordinator_c1"}
    control = hcm_of(listeners["control"])["route_config"]["virtual_hosts"][0]["routes"]
    assert not any("Metaserver" in r["match"].get("prefix", "") for r in control)
    assert_envoy_accepts(mesh, tmp_path)


def test_replicas_reached_by_name_are_dns_clusters_and_their_names_are_in_the_certificates(tmp_path):
    mesh = parse_mesh_config(
        {
            "envoy": {"grpc_listen": "127.0.0.1:9000", "grpc_address": "envoy.tandem.svc:9000"},
            "coordinator": {
                "listen": "0.0.0.0:9100",
                "replicas": 2,
                "etcd": {"endpoint": "127.0.0.1:2379"},
                "replica_addresses": ["coordinator-0.coordinator:9100", "coordinator-1.coordinator:9100"],
            },
            "conductor": {"listen": "0.0.0.0:9200", "replica_addresses": ["localhost:9200"]},
        }
    )
    clusters = {c["name"]: c for c in build_envoy_config(mesh, DESCRIPTOR)["static_resources"]["clusters"]}
    assert clusters["coordinator"]["type"] == "STRICT_DNS"
    assert clusters["coordinator"]["dns_lookup_family"] == "V4_PREFERRED"  # localhost: 127.0.0.1, not ::1
    hosts = [
        e["endpoint"]["address"]["socket_address"]["address"]
        for e in clusters["coordinator"]["load_assignment"]["endpoints"][0]["lb_endpoints"]
    ]
    assert hosts == ["coordinator-0.coordinator", "coordinator-1.coordinator"]
    assert (
        clusters["coordinator_c1"]["type"] == "STRICT_DNS" and clusters["conductor"]["type"] == "STRICT_DNS"
    )
    assert clusters["engines"]["type"] == "ORIGINAL_DST"
    assert all(clusters[name]["type"] == "STATIC" for name in clusters if name.startswith("agent_"))
    ensure_certs(tmp_path / "certs", mesh)
    coordinator = x509.load_pem_x509_certificate((tmp_path / "certs" / "coordinator.pem").read_bytes())
    names = coordinator.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert {"coordinator-0.coordinator", "coordinator-1.coordinator"} <= set(
        names.get_values_for_type(x509.DNSName)
    )
    envoy = x509.load_pem_x509_certificate((tmp_path / "certs" / "envoy.pem").read_bytes())
    names = envoy.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "envoy.tandem.svc" in names.get_values_for_type(x509.DNSName)
    assert_envoy_accepts(mesh, tmp_path)


def test_a_model_with_its_own_idle_timeout_gets_a_route_for_its_engines(tmp_path):
    mesh = load_mesh_config(ROOT / "configs/default.yaml").model_copy(deep=True)
    mesh.models = [ModelConfig(name=mesh.node_agents[0].engines[0].model, upstream_idle_timeout_s=900)]
    hcm = hcm_of(build_envoy_config(mesh, DESCRIPTOR)["static_resources"]["listeners"][0])
    routes = hcm["route_config"]["virtual_hosts"][0]["routes"]
    first, generic = routes[0], routes[1]
    assert first["route"]["idle_timeout"] == "900s" and generic["route"]["idle_timeout"] == "120s"
    regex = re.compile(first["match"]["headers"][0]["string_match"]["safe_regex"]["regex"])
    engine = mesh.node_agents[0].engines[0]
    primary = f"{engine.host}:{engine.port}"
    assert regex.search(primary) and regex.search(f"{primary},10.9.9.9:1") and not regex.search(f"{primary}0")
    assert first["route"]["retry_policy"] == generic["route"]["retry_policy"]
    assert_envoy_accepts(mesh, tmp_path)


@pytest.mark.parametrize("mesh_file", ["configs/default.yaml", "examples/pd-handoff.yaml"])
def test_no_coordinator_is_an_openai_503_on_either_decision_path(mesh_file, tmp_path):
    """The real Envoy with no coordinator behind it: the decision call fails, the client gets OpenAI-style JSON."""
    ports = free_ports(5)
    data = yaml.safe_load((ROOT / mesh_file).read_text())
    data.pop("security", None)
    data["envoy"] = {
        **data.get("envoy", {}),
        **{
            f"{k}_listen": f"127.0.0.1:{p}"
            for k, p in zip(["http", "grpc", "callback"], ports[:3], strict=True)
        },
        "base_id": ports[0],
    }
    data["coordinator"] = {**data.get("coordinator", {}), "listen": f"127.0.0.1:{ports[4]}"}
    mesh = parse_mesh_config(data)
    ensure_certs(tmp_path / "certs", mesh)
    admin = tmp_path / "envoy-admin.sock"
    path = write_envoy_config(mesh, DESCRIPTOR, tmp_path / "envoy.yaml", tmp_path / "certs", admin)
    envoy = subprocess.Popen(
        [envoy_binary(), "-c", str(path), "--base-id", str(ports[0]), "--log-level", "error"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_until(lambda: _ready(admin), 30, "Envoy ready")
        reply = httpx.post(
            f"http://127.0.0.1:{ports[0]}/v1/completions",
            json={"model": "tandem-sim", "prompt": "hi"},
            timeout=10,
        )
    finally:
        envoy.terminate()
        envoy.wait(10)
    assert reply.status_code == 503 and reply.headers["content-type"] == "application/json"
    assert reply.json()["error"]["type"] == "ServiceUnavailableError"
    assert "coordinator" in reply.json()["error"]["message"]


def _ready(admin: Path) -> bool:
    try:
        return admin_get(admin, "/ready", timeout=1)[0] == 200
    except OSError:
        return False


def test_the_decision_timeouts_outlast_the_admission_queue():
    """With SLO-aware admission on, Envoy waits for a decision for the queue's longest TTL more (ext_authz's timeout,
    ext_proc's message timeout, the per-try retry timeout, the whole-request timer): a held decision is never cut."""
    flow = {"enabled": True, "flex": {"ttft_slo_s": 10, "tpot_slo_s": 1, "max_queued": 4, "queue_ttl_s": 25}}
    mesh = parse_mesh_config({"coordinator": {"flow_control": flow}})
    assert mesh.decision_timeout_s == 30.0  # 5 s + the flex TTL (the largest)
    ingress = hcm_of(build_envoy_config(mesh, DESCRIPTOR)["static_resources"]["listeners"][0])
    authz = ingress["http_filters"][0]["typed_config"]
    assert authz["grpc_service"]["timeout"] == "30s"
    assert authz["grpc_service"]["retry_policy"]["retry_back_off"]["max_interval"] == "30s"
    assert ingress["request_timeout"] == "90s"  # the body's 60 s plus the decision's longest
    pd = parse_mesh_config({"coordinator": {"flow_control": flow, "pd_mode": "prefill_handoff_decode"}})
    ext_proc = hcm_of(build_envoy_config(pd, DESCRIPTOR)["static_resources"]["listeners"][0])["http_filters"][
        0
    ]
    assert ext_proc["typed_config"]["message_timeout"] == "30s"
    off = parse_mesh_config({})
    assert off.decision_timeout_s == 5.0


def test_tracing_adds_the_opentelemetry_tracer_and_its_collector_only_when_configured(tmp_path):
    mesh = load_mesh_config(ROOT / "configs/default.yaml")
    config = build_envoy_config(mesh, DESCRIPTOR)
    assert "tracing" not in hcm_of(config["static_resources"]["listeners"][0])
    assert all(c["name"] != "otel_collector" for c in config["static_resources"]["clusters"])

    ca = tmp_path / "collector-ca.pem"
    ca.write_text("")
    for tracing in (
        {"otlp_endpoint": "127.0.0.1:4317", "sample_ratio": 0.25},
        {"otlp_endpoint": "otel.monitoring:4317", "sample_ratio": 1, "otlp_tls": True, "ca_file": str(ca)},
    ):
        traced = mesh.model_copy(update={"tracing": parse_mesh_config({"tracing": tracing}, "m").tracing})
        config = build_envoy_config(traced, DESCRIPTOR)
        hcm = hcm_of(config["static_resources"]["listeners"][0])
        assert hcm["tracing"]["random_sampling"]["value"] == tracing["sample_ratio"] * 100
        provider = hcm["tracing"]["provider"]
        assert provider["name"] == "envoy.tracers.opentelemetry"
        assert provider["typed_config"]["service_name"] == "envoy"
        (collector,) = [c for c in config["static_resources"]["clusters"] if c["name"] == "otel_collector"]
        assert ("transport_socket" in collector) == bool(tracing.get("otlp_tls"))
        # Only the ingress is traced: the control and callback listeners have no tracer.
        assert all(
            "tracing" not in hcm_of(listener) for listener in config["static_resources"]["listeners"][1:]
        )
        if not tracing.get("otlp_tls"):  # Envoy reads the CA file at start: validated with a plain collector
            assert_envoy_accepts(traced, tmp_path)

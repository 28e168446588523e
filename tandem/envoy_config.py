"""Envoy's bootstrap, generated from the mesh config.

- Ingress (`envoy.http_listen`, HTTP/1.1 and h2c): every request goes through the ext_proc filter to the
  coordinator (request headers sent, request body buffered, responses skipped) and then to the `engines`
  ORIGINAL_DST cluster, whose load balancer connects to the `host:port` in the header the coordinator set.
  Responses stream from the engine to the client through Envoy only. A request without that header never
  reaches an engine: it matches the fallback route, a 503.
- gRPC (`envoy.grpc_listen`): `/tandem.v1.Conductor/*` to the conductor, `/tandem.v1.NodeAgent/*` to a node agent
  (the `tandem-node` header picks one, the first by default), everything else (Admin, Registry, Metaserver,
  health, reflection) to the coordinator. The Metaserver's JSON callback (`POST /v1/metaserver`) is transcoded
  to `tandem.v1.Metaserver/Trigger` on the same listener.
- Admin (`envoy.admin_listen`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from tandem.config import MeshConfig
from tandem.netaddr import split_host_port

DESTINATION_HEADER = "x-tandem-destination"
#: The dynamic-metadata namespace of the ext_proc decision (coordinator.access_log.METADATA_NAMESPACE).
METADATA_NAMESPACE = "tandem"
#: The paths the coordinator routes (coordinator.openai_request.ROUTED_PATHS).
ROUTED_PATHS = ("/v1/completions", "/v1/chat/completions")
NODE_HEADER = "tandem-node"
_BUFFER_LIMIT = 32 * 1024 * 1024  # bodies are buffered for ext_proc: allow long prompts
_HCM = "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"
_ROUTER = {
    "name": "envoy.filters.http.router",
    "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"},
}
_NO_DESTINATION = (
    '{"error": {"message": "The coordinator did not route this request.", '
    '"type": "ServiceUnavailableError", "param": null, "code": 503}}'
)


def _socket(address: str) -> dict[str, Any]:
    host, port = split_host_port(address)
    return {"socket_address": {"address": host, "port_value": port}}


def _grpc_cluster(name: str, address: str) -> dict[str, Any]:
    return {
        "name": name,
        "type": "STATIC",
        "connect_timeout": "2s",
        "typed_extension_protocol_options": {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                "explicit_http_config": {"http2_protocol_options": {}},
            }
        },
        "load_assignment": {
            "cluster_name": name,
            "endpoints": [{"lb_endpoints": [{"endpoint": {"address": _socket(address)}}]}],
        },
    }


def _hcm(prefix: str, routes: list[dict[str, Any]], filters: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "name": "envoy.filters.network.http_connection_manager",
        "typed_config": {
            "@type": _HCM,
            "stat_prefix": prefix,
            "codec_type": "AUTO",
            "preserve_external_request_id": True,
            "stream_idle_timeout": "3600s",
            "route_config": {
                "name": prefix,
                "virtual_hosts": [{"name": prefix, "domains": ["*"], "routes": routes}],
            },
            "http_filters": [*filters, _ROUTER],
        },
    }


def _access_log(mesh: MeshConfig) -> dict[str, Any]:
    """Envoy's gRPC access log to the coordinator: one entry per ingress request when its HTTP stream ends
    (completed, failed or cut by the client), carrying the decision's ticket in its dynamic metadata. This is
    how the coordinator learns a routed request ended and releases its workload."""
    return {
        "name": "envoy.access_loggers.http_grpc",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.access_loggers.grpc.v3.HttpGrpcAccessLogConfig",
            "common_config": {
                "log_name": "tandem_ingress",
                "transport_api_version": "V3",
                "grpc_service": {"envoy_grpc": {"cluster_name": "coordinator"}},
                "buffer_flush_interval": f"{mesh.envoy.access_log_flush_ms / 1000:g}s",
            },
        },
    }


def _ext_proc_ingress(mesh: MeshConfig) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Filters and routes of the ext_proc decision path: one body message each way."""
    timeout = mesh.envoy.ext_proc_timeout_ms / 1000
    ext_proc = {
        "name": "envoy.filters.http.ext_proc",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
            "grpc_service": {"envoy_grpc": {"cluster_name": "coordinator"}},
            # Never forward a request the coordinator did not route.
            "failure_mode_allow": False,
            "message_timeout": f"{timeout:g}s",
            # The coordinator extends the timer of a reply that waits for P/D prefill legs, up to this.
            "max_message_timeout": f"{max(mesh.coordinator.prefill_budget_s, timeout):g}s",
            # Sent with the body: the headers themselves are not.
            "request_attributes": ["request.path", "request.method", "request.id"],
            # The decision comes back as dynamic metadata in this namespace (destination, request id, ticket).
            "metadata_options": {"receiving_namespaces": {"untyped": [METADATA_NAMESPACE]}},
            # Only the buffered body goes to the coordinator; after its reply the stream closes.
            "processing_mode": {
                "request_header_mode": "SKIP",
                "response_header_mode": "SKIP",
                "request_body_mode": "BUFFERED",
                "response_body_mode": "NONE",
                "request_trailer_mode": "SKIP",
                "response_trailer_mode": "SKIP",
            },
        },
    }
    # With request headers skipped, ext_proc lets the headers through at once; this holds them until the body
    # (and so the decision) has been through ext_proc, so that the router picks the upstream after the decision.
    buffer = {
        "name": "envoy.filters.http.buffer",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.buffer.v3.Buffer",
            "max_request_bytes": _BUFFER_LIMIT,
        },
    }
    routed = [
        {
            "match": {"path": path, "headers": [{"name": ":method", "string_match": {"exact": "POST"}}]},
            "route": {"cluster": "engines", "timeout": "0s"},
            # The engine sees the request id the coordinator chose (trigger mode numbers attempts).
            "request_headers_to_add": [
                {
                    "header": {
                        "key": "x-request-id",
                        "value": f"%DYNAMIC_METADATA({METADATA_NAMESPACE}:request_id)%",
                    },
                    "append_action": "OVERWRITE_IF_EXISTS_OR_ADD",
                }
            ],
        }
        for path in ROUTED_PATHS
    ]
    # Everything else (/v1/models, health, wrong method or path) sends its headers instead and is answered by the
    # coordinator at once; the direct response is never reached.
    headers_only = {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExtProcPerRoute",
        "overrides": {
            "processing_mode": {
                "request_header_mode": "SEND",
                "response_header_mode": "SKIP",
                "request_body_mode": "NONE",
                "response_body_mode": "NONE",
            }
        },
    }
    # A body-less POST to a routed path would send ext_proc nothing: it gets the headers-only treatment too.
    empty = {
        "match": {"prefix": "/", "headers": [{"name": "content-length", "string_match": {"exact": "0"}}]},
        "direct_response": {"status": 503, "body": {"inline_string": _NO_DESTINATION}},
        "typed_per_filter_config": {"envoy.filters.http.ext_proc": headers_only},
    }
    other = {
        "match": {"prefix": "/"},
        "direct_response": {"status": 503, "body": {"inline_string": _NO_DESTINATION}},
        "response_headers_to_add": [{"header": {"key": "content-type", "value": "application/json"}}],
        "typed_per_filter_config": {"envoy.filters.http.ext_proc": headers_only},
    }
    return [ext_proc, buffer], [empty, *routed, other]


def _ext_authz_ingress(mesh: MeshConfig) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Filters and routes of the ext_authz decision path: one unary Check with the body."""
    ext_authz = {
        "name": "envoy.filters.http.ext_authz",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_authz.v3.ExtAuthz",
            "grpc_service": {
                "envoy_grpc": {"cluster_name": "coordinator"},
                "timeout": f"{mesh.envoy.ext_proc_timeout_ms / 1000:g}s",
            },
            "transport_api_version": "V3",
            # Never forward a request the coordinator did not route; if it cannot be reached, a 503.
            "failure_mode_allow": False,
            "status_on_error": {"code": "ServiceUnavailable"},
            # The whole body goes with the Check (the coordinator needs the prompt), as bytes.
            "with_request_body": {
                "max_request_bytes": _BUFFER_LIMIT,
                "allow_partial_message": False,
                "pack_as_bytes": True,
            },
            # The destination header the coordinator sets picks the route below.
            "clear_route_cache": True,
        },
    }
    routes = [
        {
            "match": {"prefix": "/", "headers": [{"name": DESTINATION_HEADER, "present_match": True}]},
            "route": {"cluster": "engines", "timeout": "0s"},
        },
        {
            "match": {"prefix": "/"},
            "direct_response": {"status": 503, "body": {"inline_string": _NO_DESTINATION}},
            "response_headers_to_add": [{"header": {"key": "content-type", "value": "application/json"}}],
        },
    ]
    return [ext_authz], routes


def _ingress(mesh: MeshConfig) -> dict[str, Any]:
    if mesh.decision_path == "ext_authz":
        filters, routes = _ext_authz_ingress(mesh)
    else:
        filters, routes = _ext_proc_ingress(mesh)
    hcm = _hcm("ingress", routes, filters)
    hcm["typed_config"]["access_log"] = [_access_log(mesh)]
    # Should a request reach the engines without a destination (it cannot, short of a bug), the client still gets
    # an OpenAI-shaped 503 rather than Envoy's plain text.
    hcm["typed_config"]["local_reply_config"] = {
        "mappers": [
            {
                "filter": {"response_flag_filter": {"flags": ["UH"]}},
                "status_code": 503,
                "body": {"inline_string": _NO_DESTINATION},
                "body_format_override": {
                    "text_format_source": {"inline_string": "%LOCAL_REPLY_BODY%"},
                    "content_type": "application/json",
                },
            }
        ]
    }
    return {
        "name": "ingress",
        "address": _socket(mesh.envoy.http_listen),
        "per_connection_buffer_limit_bytes": _BUFFER_LIMIT,
        "filter_chains": [{"filters": [hcm]}],
    }


def _grpc_listener(mesh: MeshConfig, descriptor: Path) -> dict[str, Any]:
    routes: list[dict[str, Any]] = [
        {"match": {"prefix": "/tandem.v1.Conductor/"}, "route": {"cluster": "conductor", "timeout": "0s"}}
    ]
    for agent in mesh.node_agents:
        routes.append(
            {
                "match": {
                    "prefix": "/tandem.v1.NodeAgent/",
                    "headers": [{"name": NODE_HEADER, "string_match": {"exact": agent.node_id}}],
                },
                "route": {"cluster": f"agent_{agent.node_id}", "timeout": "0s"},
            }
        )
    if mesh.node_agents:
        first = mesh.node_agents[0].node_id
        routes.append(
            {
                "match": {"prefix": "/tandem.v1.NodeAgent/"},
                "route": {"cluster": f"agent_{first}", "timeout": "0s"},
            }
        )
    routes.append({"match": {"prefix": "/"}, "route": {"cluster": "coordinator", "timeout": "0s"}})
    transcoder = {
        "name": "envoy.filters.http.grpc_json_transcoder",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.grpc_json_transcoder.v3.GrpcJsonTranscoder",
            "proto_descriptor": str(descriptor),
            "services": ["tandem.v1.Metaserver"],
            "print_options": {"preserve_proto_field_names": True, "always_print_primitive_fields": True},
            "convert_grpc_status": True,
        },
    }
    return {
        "name": "grpc",
        "address": _socket(mesh.envoy.grpc_listen),
        "filter_chains": [{"filters": [_hcm("grpc", routes, [transcoder])]}],
    }


def _original_dst(mesh: MeshConfig) -> dict[str, Any]:
    """Where the `engines` cluster reads the chosen engine's `host:port` from."""
    if mesh.decision_path == "ext_authz":
        return {"use_http_header": True, "http_header_name": DESTINATION_HEADER}
    return {"metadata_key": {"key": METADATA_NAMESPACE, "path": [{"key": "destination"}]}}


def build_envoy_config(mesh: MeshConfig, descriptor: Path) -> dict[str, Any]:
    """The Envoy bootstrap for `mesh`; `descriptor` is the `tandem.v1` descriptor set (with imports)."""
    clusters = [
        {
            "name": "engines",
            "type": "ORIGINAL_DST",
            "lb_policy": "CLUSTER_PROVIDED",
            "connect_timeout": "5s",
            "per_connection_buffer_limit_bytes": _BUFFER_LIMIT,
            "original_dst_lb_config": _original_dst(mesh),
            "circuit_breakers": {
                "thresholds": [
                    {"max_connections": 100000, "max_pending_requests": 100000, "max_requests": 100000}
                ]
            },
        },
        _grpc_cluster("coordinator", mesh.coordinator.listen),
        _grpc_cluster("conductor", mesh.conductor.listen),
        *(_grpc_cluster(f"agent_{a.node_id}", a.listen) for a in mesh.node_agents),
    ]
    return {
        "admin": {"address": _socket(mesh.envoy.admin_listen)},
        "static_resources": {
            "listeners": [_ingress(mesh), _grpc_listener(mesh, descriptor)],
            "clusters": clusters,
        },
    }


def write_envoy_config(mesh: MeshConfig, descriptor: Path, path: Path) -> Path:
    """Writes the bootstrap YAML to `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(build_envoy_config(mesh, descriptor), sort_keys=False))
    return path

"""Envoy's bootstrap, rendered from the commented template `envoy/envoy.yaml.j2` and the mesh file.

The template is the reference for what each listener, filter, cluster and timeout does and why; this module only
computes the values it needs. The rendering keeps the template's comments, so `run/envoy.yaml` can be reviewed.
"""

from __future__ import annotations

import http.client
import re
import socket
from pathlib import Path
from typing import Any

import jinja2
import yaml

from coordinator.access_log import EXT_AUTHZ_NAMESPACE, METADATA_NAMESPACE
from coordinator.decision import API_KEY_HEADERS
from coordinator.ext_proc import REQUEST_ATTRIBUTES, RESPONSE_HEADER_KEYS
from coordinator.understanding import ROUTED_PATHS
from mesh.config import MeshConfig
from node_agent.launch import Placement, registered_instance_ids
from tandem import tls as tandem_tls
from tandem.limits import MAX_BODY_BYTES
from tandem.netaddr import is_ip, join_host_port, split_host_port

#: The template (a folder of the repository, next to the components: Envoy is a process of the mesh).
TEMPLATE = Path(__file__).resolve().parents[1] / "envoy" / "envoy.yaml.j2"
#: Envoy's admin unix socket in the run directory (`envoy.admin_socket` overrides it).
ADMIN_SOCKET_NAME = "envoy-admin.sock"
#: The header Envoy's ORIGINAL_DST cluster reads the engine's `host:port` from; only the coordinator sets it.
DESTINATION_HEADER = "x-tandem-destination"
#: The request header the coordinator sets to the client's X-Request-Id (coordinator/request_ids.py), echoed back.
CLIENT_ID_HEADER = "x-tandem-client-request-id"
#: The header that picks a node agent on the gRPC listener.
NODE_HEADER = "tandem-node"
#: Bodies are buffered for the coordinator's decision: the longest prompt a client may send (the coordinator's gRPC
#: message limit follows it, `tandem.limits`).
BUFFER_LIMIT = MAX_BODY_BYTES
#: Client headers an engine never gets (credentials meant for the mesh or its web front, not for engines).
ENGINE_REMOVED_HEADERS = ("cookie", "api-key")
#: The largest metaserver callback body the callback listener takes (413 beyond): the prompt's token ids of a
#: 256k-token prompt and its block ids fit.
CALLBACK_BODY_LIMIT = 4 * 1024 * 1024
#: Envoy's heap past which the overload manager sheds load.
MAX_HEAP_BYTES = 1024 * 1024 * 1024
#: Who may call what through the control listener (Envoy RBAC; each service checks its own rules again):
#: (policy, gRPC path prefixes, role patterns of `tandem.tls`).
CONTROL_ACCESS = [
    (
        "operator",
        [
            "/tandem.v1.Admin/",
            "/tandem.v1.NodeAgent/",
            "/tandem.v1.Conductor/GetIndexStats",
            "/tandem.v1.Conductor/Match",
            "/grpc.health.v1.Health/",
            "/grpc.reflection.",
        ],
        ["operator"],
    ),
    (
        "node-agents",
        ["/tandem.v1.Registry/", "/tandem.v1.Conductor/Ingest", "/grpc.health.v1.Health/"],
        ["agent/*"],
    ),
    # A coordinator reaching conductor replicas through Envoy (Match sent to a healthy replica), and a node's agent
    # to place LoRA adapters (NodeAgent/LoadAdapter, UnloadAdapter; the agent allows those to it alone).
    (
        "coordinators",
        [
            "/tandem.v1.Conductor/Match",
            "/tandem.v1.NodeAgent/LoadAdapter",
            "/tandem.v1.NodeAgent/UnloadAdapter",
            "/grpc.health.v1.Health/",
        ],
        ["coordinator"],
    ),
]
#: What the control listener routes to the coordinator (nothing else is routed there).
COORDINATOR_SERVICES = [
    "/tandem.v1.Admin/",
    "/tandem.v1.Registry/",
    "/grpc.health.v1.Health/",
    "/grpc.reflection.v1alpha.ServerReflection/",
    "/grpc.reflection.v1.ServerReflection/",
]
_NO_DESTINATION = (
    '{"error": {"message": "The coordinator did not route this request.", '
    '"type": "ServiceUnavailableError", "param": null, "code": 503}}'
)


_NO_COORDINATOR = (
    '{"error": {"message": "No coordinator could decide where this request goes; retry shortly.", '
    '"type": "ServiceUnavailableError", "param": null, "code": 503}}'
)


def _seconds(value: float) -> str:
    return f"{value:g}s"


def _engine_endpoints(mesh: MeshConfig, model: str | None = None) -> list[tuple[str, int]]:
    """(host, port) of every engine API server of the mesh file (one per local DP rank in external LB), or of the
    engines serving `model`."""
    return sorted(
        {
            split_host_port(join_host_port(e.host, e.port + i))
            for a in mesh.node_agents
            for e in a.engines
            if model is None or e.model == model
            for i in range(len(registered_instance_ids(e, Placement(node_rank=0))))
        }
    )


def _model_routes(mesh: MeshConfig) -> list[tuple[str, str, str]]:
    """(model, idle timeout, regex matching a destination header whose first address is one of its engines) for
    each model with its own `upstream_idle_timeout_s`."""
    routes = []
    for model in mesh.models:
        if model.upstream_idle_timeout_s is None:
            continue
        addresses = [join_host_port(host, port) for host, port in _engine_endpoints(mesh, model.name)]
        if addresses:
            pattern = "^(" + "|".join(re.escape(a) for a in addresses) + ")(,|$)"
            routes.append((model.name, _seconds(model.upstream_idle_timeout_s), pattern))
    return routes


def cluster_type(endpoints: list[tuple[str, int]]) -> str:
    """Envoy's cluster type for these endpoints: STATIC when every host is an IP address, else STRICT_DNS."""
    return "STATIC" if all(is_ip(host) for host, _ in endpoints) else "STRICT_DNS"


def _tracing(mesh: MeshConfig) -> dict[str, object] | None:
    """The ingress tracer's settings (None: tracing off, no tracer and no collector cluster in Envoy)."""
    tracing = mesh.tracing
    if tracing.otlp_endpoint is None:
        return None
    return {
        "address": split_host_port(tracing.otlp_endpoint),
        "percent": round(tracing.sample_ratio * 100, 6),
        "ca_file": str(Path(tracing.ca_file).resolve()) if tracing.ca_file else None,
    }


def _retry_policy(engines_cluster: str) -> dict[str, object]:
    """The engines route's retry policy (explained in the template), repeated by the per-model routes."""
    policy: dict[str, object] = {"retry_on": "connect-failure,refused-stream,reset", "num_retries": 1}
    if engines_cluster == "static":
        policy["retry_host_predicate"] = [
            {
                "name": "envoy.retry_host_predicates.previous_hosts",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.retry.host.previous_hosts.v3.PreviousHostsPredicate"
                },
            }
        ]
        policy["host_selection_retry_max_attempts"] = 5
    return policy


def _local_replies() -> list[tuple[int, str, str]]:
    mib = BUFFER_LIMIT // (1024 * 1024)
    return [
        (413, "RequestEntityTooLargeError", f"The request body is larger than the {mib} MiB limit."),
        (431, "RequestHeaderFieldsTooLargeError", "The request headers are too large."),
        (408, "RequestTimeoutError", "The request did not arrive in time."),
    ]


def _local_errors() -> list[tuple[int, str, str, str]]:
    """(status, OpenAI type, message, CEL condition) of the errors Envoy answers itself besides `_local_replies`,
    most specific first: the client gets OpenAI's JSON error shape with Envoy's reason."""
    reason = " (%RESPONSE_CODE_DETAILS%)"
    underscore = "response.code_details.endsWith('unexpected_underscore')"
    return [
        (400, "BadRequestError", "Header names with underscores are not accepted.", underscore),
        (400, "BadRequestError", "The request is malformed" + reason + ".", "response.code == 400"),
        (404, "NotFoundError", "Not found" + reason + ".", "response.code == 404"),
        (500, "InternalServerError", "The mesh failed this request" + reason + ".", "response.code == 500"),
        (
            502,
            "BadGatewayError",
            "The engine's answer was not valid" + reason + "; retry shortly.",
            "response.code == 502",
        ),
        (
            503,
            "ServiceUnavailableError",
            "The engine for this request could not be reached" + reason + "; retry shortly.",
            "response.code == 503",
        ),
        (
            504,
            "GatewayTimeoutError",
            "The engine for this request sent nothing in time" + reason + ".",
            "response.code == 504",
        ),
    ]


def api_keys_configured(mesh: MeshConfig) -> bool:
    """Whether the coordinator checks API keys (it refuses to start when a named file or variable holds none;
    tenants bring keys too)."""
    c = mesh.coordinator
    return bool(c.api_keys_file or c.api_keys_env or c.tenants or c.tenants_file)


def admin_socket_path(mesh: MeshConfig, run_dir: Path) -> Path:
    """Envoy's admin unix socket: `envoy.admin_socket`, else `<run_dir>/envoy-admin.sock`."""
    return Path(mesh.envoy.admin_socket) if mesh.envoy.admin_socket else run_dir / ADMIN_SOCKET_NAME


def admin_get(socket_path: Path | str, path: str, timeout: float = 5.0) -> tuple[int, str]:
    """GET `path` (e.g. `/ready`, `/stats?filter=...`) from Envoy's admin interface at its unix socket: the
    status and the body. Raises OSError when the socket does not answer."""

    class _Connection(http.client.HTTPConnection):
        def connect(self) -> None:
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.sock.settimeout(timeout)
            self.sock.connect(str(socket_path))

    connection = _Connection("envoy-admin", timeout=timeout)
    try:
        connection.request("GET", path)
        reply = connection.getresponse()
        return reply.status, reply.read().decode(errors="replace")
    except http.client.HTTPException as exc:
        raise OSError(f"Envoy admin {socket_path}: {exc}") from exc
    finally:
        connection.close()


def render_envoy_config(
    mesh: MeshConfig, descriptor: Path, certs: Path | None = None, admin_socket: Path | None = None
) -> str:
    """The bootstrap YAML for `mesh`, comments included; `descriptor` is the `tandem.v1` descriptor set; `certs`
    the directory of `tandem certs` (default ./certs), unused in insecure mode; `admin_socket` Envoy's admin unix
    socket (default: `admin_socket_path` in ./run)."""
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(TEMPLATE.parent),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        autoescape=False,
    )
    env.filters["cluster_type"] = cluster_type
    envoy = mesh.envoy
    ext_proc_s = mesh.decision_timeout_s  # with the admission queue's longest TTL (coordinator.flow_control)
    prefill_budget_s = max(mesh.coordinator.prefill_budget_s, ext_proc_s)
    # The longest a decision may hold a whole request before it goes to an engine: ext_proc's extended timer (a
    # handoff's prefill leg runs during it), else one decision call.
    decision_max_s = prefill_budget_s if mesh.decision_path == "ext_proc" else ext_proc_s
    agents = [(a.node_id, split_host_port(a.listen)) for a in mesh.node_agents]
    engines = _engine_endpoints(mesh) if envoy.engines_cluster == "static" else []
    tls = None
    if not mesh.security.insecure:
        directory = certs if certs is not None else Path("certs")
        tls = {
            "ca": str(directory / "ca.pem"),
            "cert": str(directory / "envoy.pem"),
            "key": str(directory / "envoy-key.pem"),
        }
    return env.get_template(TEMPLATE.name).render(
        mesh=mesh,
        listen={
            "http": split_host_port(envoy.http_listen),
            "grpc": split_host_port(envoy.grpc_listen),
            "callback": split_host_port(envoy.callback_listen),
        },
        admin_socket=str(admin_socket or admin_socket_path(mesh, Path("run"))),
        descriptor=str(descriptor),
        timeouts={
            "ext_proc": _seconds(ext_proc_s),
            "ext_proc_max": _seconds(prefill_budget_s),
            "access_log_flush": _seconds(envoy.access_log_flush_ms / 1000),
        },
        decision=mesh.decision_path,
        tracing=_tracing(mesh),
        routed_paths=list(ROUTED_PATHS),
        metadata_namespace=METADATA_NAMESPACE,
        # Where the decision filter leaves the ticket in dynamic metadata (ext_authz: under its own name).
        ticket_namespace=METADATA_NAMESPACE if mesh.decision_path == "ext_proc" else EXT_AUTHZ_NAMESPACE,
        request_attributes=list(REQUEST_ATTRIBUTES),
        response_header_keys=list(RESPONSE_HEADER_KEYS),
        # Headers the ext_proc routes remove (ext_authz removes them on the coordinator's word): the API key.
        removed_headers=list(API_KEY_HEADERS) if api_keys_configured(mesh) else [],
        agents=agents,
        engines_cluster=envoy.engines_cluster,
        engine_endpoints=engines,
        upstream_idle_timeout=_seconds(envoy.upstream_idle_timeout_s),
        model_routes=_model_routes(mesh),
        retry_policy=_retry_policy(envoy.engines_cluster),
        grpc_agents=[(f"agent_{node_id}", address, f"agent/{node_id}") for node_id, address in agents],
        tls=tls,
        control_rbac=CONTROL_ACCESS,
        revoked_roles=[f"agent/{node}" for node in mesh.security.revoked_nodes],
        coordinator_services=COORDINATOR_SERVICES,
        identity_prefix=tandem_tls.PREFIX,
        listener_header=tandem_tls.LISTENER_HEADER,
        client_id_header=CLIENT_ID_HEADER,
        local_replies=_local_replies(),
        local_errors=_local_errors(),
        engine_removed_headers=list(ENGINE_REMOVED_HEADERS)
        + (list(API_KEY_HEADERS) if api_keys_configured(mesh) else []),
        limits={
            "max_connections": envoy.max_connections,
            "max_connections_per_listener": envoy.max_connections_per_listener,
            "max_heap_bytes": MAX_HEAP_BYTES,
            "request_headers_timeout": _seconds(envoy.request_headers_timeout_s),
            "request_timeout": _seconds(envoy.request_body_timeout_s + decision_max_s),
            "first_byte_timeout": _seconds(envoy.first_byte_timeout_s),
            "idle_timeout": _seconds(envoy.idle_timeout_s),
            "min_idle_timeout": _seconds(min(envoy.min_idle_timeout_s, envoy.idle_timeout_s)),
            # The overload manager sees all listeners' connections together: it shortens idle timeouts from half
            # of one listener's limit on and reaches the shortest at 90% of it.
            "scale_from": round(
                min(0.5, 0.5 * envoy.max_connections_per_listener / envoy.max_connections), 4
            ),
            "scale_until": round(
                min(0.9, 0.9 * envoy.max_connections_per_listener / envoy.max_connections), 4
            ),
            "max_request_headers_kb": envoy.max_request_headers_kb,
        },
        coordinators=[split_host_port(a) for a in mesh.coordinator.replica_endpoints],
        conductors=[split_host_port(a) for a in mesh.conductor.replica_endpoints],
        # One cluster per coordinator replica, for the metaserver callbacks that must reach it.
        replica_clusters=[
            (f"coordinator_c{i}", split_host_port(a), "coordinator")
            for i, a in enumerate(mesh.coordinator.replica_endpoints)
        ],
        destination_header=DESTINATION_HEADER,
        node_header=NODE_HEADER,
        buffer_limit=BUFFER_LIMIT,
        callback_body_limit=CALLBACK_BODY_LIMIT,
        no_destination_body=_NO_DESTINATION,
        no_coordinator_body=_NO_COORDINATOR,
    )


def build_envoy_config(
    mesh: MeshConfig, descriptor: Path, certs: Path | None = None, admin_socket: Path | None = None
) -> dict[str, Any]:
    """The rendered bootstrap as a document (for checks and tests)."""
    return yaml.safe_load(render_envoy_config(mesh, descriptor, certs, admin_socket))


def write_envoy_config(
    mesh: MeshConfig,
    descriptor: Path,
    path: Path,
    certs: Path | None = None,
    admin_socket: Path | None = None,
) -> Path:
    """Writes the rendered bootstrap to `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render_envoy_config(mesh, descriptor, certs, admin_socket))
    return path

"""The mesh config file: one YAML document describing Envoy, coordinator, conductor, models and node agents.

Every section belongs to the component that reads it (`coordinator.config`, `conductor.config`,
`node_agent.config`); this module assembles them and turns any mistake into one `ConfigError` line naming the key.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from conductor.config import ConductorConfig
from coordinator.admission import NodeBook
from coordinator.config import CoordinatorConfig, PdMode
from node_agent.config import LoraAdapterConfig, NodeAgentConfig
from tandem.config_file import ConfigError, read_yaml, validate
from tandem.netaddr import Address, is_wildcard, split_host_port
from tandem.tracing_config import TracingConfig

__all__ = ["ConfigError", "MeshConfig", "load_mesh_config", "parse_mesh_config"]

#: The longest an access-log entry takes from Envoy's flush to the coordinator's ticket table (the gRPC stream's
#: trip and the coordinator's turn on a busy host), on top of the flush interval.
ACCESS_LOG_TRIP_S = 0.1


class EnvoyConfig(BaseModel):
    """Where Envoy listens. Loopback by default: a mesh binds no public address unless told to."""

    model_config = ConfigDict(extra="forbid")

    http_listen: Address = "127.0.0.1:8000"
    """OpenAI-compatible ingress (HTTP/1.1 and h2c)."""
    grpc_listen: Address = "127.0.0.1:9000"
    """The control listener: operators' and node agents' gRPC (every `tandem.v1` service, health, reflection),
    mutual TLS with per-service authorization by certificate identity (docs/security.md)."""
    grpc_address: Address | None = None
    """`host:port` node agents and coordinator replicas reach the control listener at (e.g. a Kubernetes Service
    name); `grpc_listen` when unset. Required when `grpc_listen` is a wildcard."""
    callback_listen: Address = "127.0.0.1:9002"
    """The engines' callback listener: only the metaserver callback (JSON, transcoded to `Metaserver.Trigger`),
    HTTPS with the mesh CA; each callback URL carries a per-attempt token."""
    admin_socket: str | None = None
    """Envoy's admin interface (stats, `/ready`; it can stop Envoy: `/quitquitquit`): a unix socket, mode 0600,
    never a network port. Unset: `<run-dir>/envoy-admin.sock` under `tandem up` (`tandem envoy-config`:
    `run/envoy-admin.sock`). At most 100 bytes (the kernel's limit for socket paths)."""
    admin_listen: str | None = None
    """Removed: the admin interface is a unix socket (`admin_socket`); a mesh file that sets it is refused."""
    base_id: int = 0
    """Envoy `--base-id`; distinct per Envoy on one machine."""
    ext_proc_timeout_ms: int = Field(default=5000, gt=0)
    """How long Envoy waits for one coordinator reply before failing the request (never forwarded unrouted)."""
    log_level: str = "warning"
    """Envoy's `--log-level`."""
    decision: Literal["auto", "ext_proc", "ext_authz"] = "auto"
    """How Envoy asks the coordinator where a request goes, one gRPC call per request either way
    (docs/architecture.md): `ext_authz` (a unary Check with the body; cannot rewrite the body), `ext_proc` (one
    body message each way; rewrites bodies, which P/D modes need). `auto`: ext_authz when no engine of the mesh
    has a prefill or decode role and `coordinator.pd_mode` is `auto` or `aggregated`, else ext_proc."""
    access_log_flush_ms: int = Field(default=20, gt=0)
    """How often Envoy flushes its access log to the coordinator (the entries that release finished requests'
    workload), at the latest: under load its 16 KiB buffer fills and flushes first (about 40 entries), so a short
    interval costs little CPU and keeps the released workload fresh at low load."""
    upstream_idle_timeout_s: float = Field(default=120.0, gt=0)
    """A routed request whose engine sends nothing for this long (no first byte, or a stalled stream) ends with 504
    instead of waiting forever on a hung engine. Above the longest prefill of the largest prompt."""
    engines_cluster: Literal["original_dst", "static"] = "original_dst"
    """`original_dst`: Envoy connects to whatever `host:port` the coordinator names (any registered engine; a
    retry can only go to the same address). `static`: the engines of `node_agents` are the cluster's endpoints and
    the coordinator's choice is an override (`host:port[,fallback...]`): a request refused before any response byte
    is retried once on the next named address (or another engine), and outlier detection ejects engines that fail."""
    max_connections: int = Field(default=10000, gt=0)
    """Connections Envoy accepts over all listeners (overload manager); past it new ones are refused."""
    max_connections_per_listener: int = Field(default=4096, gt=0)
    """Connections one listener accepts at once. From half of it on, Envoy shortens the idle timeout of
    connections without a request (overload manager, `reduce_timeouts`), down to `min_idle_timeout_s` at 90%."""
    first_byte_timeout_s: float = Field(default=5.0, gt=0)
    """A new connection that sends no byte (no request, no TLS handshake) for this long is closed."""
    request_headers_timeout_s: float = Field(default=10.0, gt=0)
    """A client must send its request headers within this of its first byte (slow-header clients are cut)."""
    request_body_timeout_s: float = Field(default=60.0, gt=0)
    """A client must send its whole request body within this (trickled bodies are cut with 408). The timer ends
    when the request goes to the engine (the decision's own time is added), so it never cuts a long response or a
    long prefill."""
    idle_timeout_s: float = Field(default=60.0, gt=0)
    """A downstream connection without any stream for this long is closed (shortened near the connection limit)."""
    min_idle_timeout_s: float = Field(default=1.0, gt=0)
    """The idle timeout near the connection limit (90% of `max_connections_per_listener`)."""
    max_request_headers_kb: int = Field(default=60, gt=0, le=8192)
    """Largest request header block (KiB) Envoy accepts; larger gets 431."""

    @model_validator(mode="after")
    def _control_reachable(self) -> EnvoyConfig:
        if self.grpc_address is None and is_wildcard(split_host_port(self.grpc_listen)[0]):
            raise ValueError(
                "grpc_address: required when grpc_listen is a wildcard (agents and replicas must be given an "
                "address they can reach)"
            )
        if self.grpc_address is not None and is_wildcard(split_host_port(self.grpc_address)[0]):
            raise ValueError(
                f"grpc_address: {self.grpc_address!r} is a wildcard address; name one others reach"
            )
        return self

    @field_validator("admin_listen")
    @classmethod
    def _no_admin_port(cls, value: str | None) -> str | None:
        if value is not None:
            raise ValueError(
                "Envoy's admin interface can stop Envoy (/quitquitquit) and is no longer on a TCP port: remove "
                "this key (the admin interface is the unix socket envoy.admin_socket, default "
                "<run-dir>/envoy-admin.sock)"
            )
        return value

    @field_validator("admin_socket")
    @classmethod
    def _socket_path_fits(cls, value: str | None) -> str | None:
        if value is not None and len(value.encode()) > 100:
            raise ValueError(f"{value!r}: a unix socket path must be at most 100 bytes")
        return value


class SecurityConfig(BaseModel):
    """Mutual TLS between components (docs/security.md)."""

    model_config = ConfigDict(extra="forbid")

    insecure: bool = False
    """Plain text between components and no authorization: only for a throwaway mesh on one machine. The
    banner of `tandem up` says so."""
    certs_dir: str | None = None
    """Where the CA and component certificates are (`tandem certs --dir`). Unset: `tandem up` creates them in
    `<run-dir>/certs`; a component started alone (`tandem coordinator ...`) needs it, or `--certs-dir`. A relative
    path is relative to the mesh file."""
    revoked_nodes: list[str] = []
    """Nodes removed from the mesh whose agent certificates (`spiffe://tandem/agent/<node_id>`) every server and
    Envoy's control listener refuse, although the mesh CA signed them (docs/security.md, "Removing a node")."""


class RestartPolicy(BaseModel):
    """`up.restart`: how `tandem up` restarts a component (conductor, coordinator, Envoy, an agent) that exits
    (`tandem.restarts`). A FAILED component is still retried every `max_backoff_s`: the others keep serving, and an
    etcd or a port that comes back heals it."""

    model_config = ConfigDict(extra="forbid")

    first_restart_s: float = Field(default=0.0, ge=0)
    """Delay before restarting a component whose exit is the first of a row (it had run stably, or it is its
    first): 0 restarts it at once, so a component killed once (a coordinator SIGKILLed) is back after its own
    start-up only."""
    initial_backoff_s: float = Field(default=0.5, gt=0)
    """Backoff of a crash loop: the second quick exit in a row waits twice this, doubling with each one."""
    max_backoff_s: float = Field(default=30.0, gt=0)
    """Cap of the doubling delay; also the retry interval of a FAILED component."""
    stable_after_s: float = Field(default=60.0, gt=0)
    """A run at least this long resets the count of quick exits."""
    failed_after: int = Field(default=5, ge=1)
    """Quick exits in a row after which the component is reported FAILED (it is still retried)."""


class UpConfig(BaseModel):
    """How `tandem up` runs the mesh's processes."""

    model_config = ConfigDict(extra="forbid")

    restart: RestartPolicy = RestartPolicy()
    """Restart of a component that exits: backoff, reset after a stable run, FAILED after a crash loop."""
    envoy_restart: RestartPolicy = RestartPolicy(initial_backoff_s=0.01, max_backoff_s=1.0)
    """Restart of Envoy. Every client connection is refused while it is down and it starts in a fraction of a
    second, holding no state: it is started again at once, and even in a crash loop (or killed again and again) at
    least every second, never after a 30 s backoff."""
    coordinator_standby: bool = True
    """Keep a spare process per coordinator, started (its modules imported) and waiting: a coordinator that exits
    is replaced by its spare, which reads the mesh file and serves without Python's start-up (most of the time a
    fresh process takes to serve again), and a new spare is started once the replacement has run
    `SPARE_AFTER_S`. False: a fresh process each time (one process less per coordinator)."""


class ModelConfig(BaseModel):
    """A model the mesh serves."""

    model_config = ConfigDict(extra="forbid")

    name: str
    """The name clients send as `model`."""
    tokenizer: str | None = None
    """A Hugging Face tokenizer directory; the built-in deterministic tokenizer (simengine's) when unset."""
    upstream_idle_timeout_s: float | None = Field(default=None, gt=0)
    """This model's requests end after this long without a byte from the engine (504 before the first byte);
    `envoy.upstream_idle_timeout_s` when unset. Set it above the model's longest prefill."""
    max_model_len: int | None = Field(default=None, gt=0)
    """The model's context length: a prompt plus `max_tokens` beyond it is answered 400 by the coordinator."""
    adapters: list[LoraAdapterConfig] = []
    """LoRA adapters of this model (`name`, `path`, optional `max_rank`): every engine serving the model gets
    LoRA enabled and loads them at start through vLLM's `/v1/load_lora_adapter` (docs/configuration.md, "LoRA
    adapters"); a request whose `model` is an adapter's name is served by the base model with that adapter."""
    max_loras: int | None = Field(default=None, ge=1)
    """Adapters one engine step may run at once (vLLM `--max-loras`, default 1); an engine's own `max_loras`
    wins."""

    @model_validator(mode="after")
    def _adapter_names(self) -> ModelConfig:
        names = [a.name for a in self.adapters]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"adapters: duplicate name {dupes[0]!r}")
        if self.name in names:
            raise ValueError(f"adapters: {self.name!r} is the model's own name")
        return self


class MeshConfig(BaseModel):
    """The whole mesh file."""

    model_config = ConfigDict(extra="forbid")

    envoy: EnvoyConfig = EnvoyConfig()
    security: SecurityConfig = SecurityConfig()
    coordinator: CoordinatorConfig = CoordinatorConfig()
    conductor: ConductorConfig = ConductorConfig()
    models: list[ModelConfig] = []
    node_agents: list[NodeAgentConfig] = []
    up: UpConfig = UpConfig()
    tracing: TracingConfig = TracingConfig()
    """OpenTelemetry traces of every component and engine (docs/operations.md, "Tracing"); off by default."""
    path: str = Field(default="", exclude=True)
    """The file the config came from (set by `load_mesh_config`)."""

    @model_validator(mode="after")
    def _topology_names_nodes(self) -> MeshConfig:
        nodes = {a.node_id for a in self.node_agents}
        for name in self.coordinator.topology.nodes:
            if nodes and name not in nodes:
                raise ValueError(
                    f"coordinator.topology.nodes.{name}: no node agent has node_id {name!r} "
                    f"(known: {', '.join(sorted(nodes))})"
                )
        return self

    @model_validator(mode="after")
    def _adapters_to_engines(self) -> MeshConfig:
        """Each model's adapters and `max_loras` go to the engines serving it that set none of their own; an
        adapter name may not be another model's name (a request naming it would be ambiguous)."""
        models = {m.name: m for m in self.models}
        for i, model in enumerate(self.models):
            for adapter in model.adapters:
                if adapter.name in models:
                    raise ValueError(
                        f"models[{i}].adapters: {adapter.name!r} is also a model's name; rename the adapter"
                    )
        for agent in self.node_agents:
            for engine in agent.engines:
                served = models.get(engine.model)
                if served is None:
                    continue
                if not engine.adapters and served.adapters:
                    engine.adapters = list(served.adapters)
                if engine.max_loras is None:
                    engine.max_loras = served.max_loras
        return self

    @model_validator(mode="after")
    def _revoked_nodes_are_gone(self) -> MeshConfig:
        for agent in self.node_agents:
            if agent.node_id in self.security.revoked_nodes:
                raise ValueError(
                    f"security.revoked_nodes: node {agent.node_id!r} is revoked but still in node_agents; "
                    "remove its entry"
                )
        return self

    @model_validator(mode="after")
    def _metaserver_reachable(self) -> MeshConfig:
        if self.coordinator.metaserver_address is None and is_wildcard(
            split_host_port(self.envoy.callback_listen)[0]
        ):
            raise ValueError(
                "coordinator.metaserver_address: required when envoy.callback_listen is a wildcard address "
                "(decode engines must be given an address they can reach)"
            )
        return self

    @model_validator(mode="after")
    def _adapter_loads_fit_the_decision(self) -> MeshConfig:
        """On ext_authz, a request waits for its adapter's load inside Envoy's decision timer (ext_proc extends
        it): a load must fit in it."""
        adapters = any(m.adapters for m in self.models)
        timeout_s = self.envoy.ext_proc_timeout_ms / 1000
        load_s = self.coordinator.adapters.load_timeout_s
        if adapters and self.decision_path == "ext_authz" and load_s >= timeout_s:
            raise ValueError(
                f"coordinator.adapters.load_timeout_s: {load_s:g} s must be below envoy.ext_proc_timeout_ms "
                f"({timeout_s:g} s) on the ext_authz decision path (a request waits for its adapter's load within "
                "it); lower it, raise the timeout, or set envoy.decision to ext_proc"
            )
        return self

    @model_validator(mode="after")
    def _priority_needs_ext_proc(self) -> MeshConfig:
        if self.coordinator.engine_priority and self.envoy.decision == "ext_authz":
            raise ValueError(
                "coordinator.engine_priority: needs envoy.decision ext_proc or auto (ext_authz cannot add the "
                "`priority` field to the body)"
            )
        return self

    @property
    def decision_path(self) -> str:
        """`ext_proc` or `ext_authz`: `envoy.decision` with `auto` resolved."""
        if self.envoy.decision != "auto":
            return self.envoy.decision
        pd_engines = any(e.role != "hybrid" for a in self.node_agents for e in a.engines)
        if (
            pd_engines
            or self.coordinator.engine_priority
            or self.coordinator.pd_mode not in (PdMode.AUTO, PdMode.AGGREGATED)
        ):
            return "ext_proc"
        return "ext_authz"

    @property
    def destination_fallback(self) -> bool:
        """The coordinator names a fallback engine with each pick when Envoy's engines cluster can use it."""
        return self.envoy.engines_cluster == "static" and self.decision_path == "ext_authz"

    @property
    def decision_timeout_s(self) -> float:
        """How long Envoy waits for one decision reply (its ext_authz timeout, ext_proc's message timeout):
        `envoy.ext_proc_timeout_ms`, plus the admission queue's longest TTL when it is on
        (`coordinator.flow_control`), so that Envoy never cuts a decision still waiting in the queue."""
        return self.envoy.ext_proc_timeout_ms / 1000 + self.coordinator.flow_control.max_wait_s

    @property
    def request_end_lag_s(self) -> float:
        """How late the coordinator can hear of a request's end after its client got the answer: Envoy's access
        log flush interval (`envoy.access_log_flush_ms`) plus the entry's trip (`ACCESS_LOG_TRIP_S`)."""
        return self.envoy.access_log_flush_ms / 1000 + ACCESS_LOG_TRIP_S

    @property
    def metaserver_url(self) -> str:
        """The callback URL decode engines get in trigger mode (Envoy's callback listener; HTTPS unless insecure);
        it names this coordinator process, and the coordinator appends a per-attempt token."""
        address = self.coordinator.metaserver_address or self.envoy.callback_listen
        scheme = "http" if self.security.insecure else "https"
        return f"{scheme}://{address}/v1/metaserver/{self.coordinator.replica}"

    @property
    def control_address(self) -> str:
        """Where other components reach Envoy's control listener."""
        return self.envoy.grpc_address or self.envoy.grpc_listen

    @property
    def conductor_match_address(self) -> str:
        """The coordinator's Match stream: the conductor, or with replicas Envoy's gRPC listener, which sends it to a
        healthy replica (and to another one when that one dies)."""
        if self.conductor.replicas > 1:
            return self.control_address
        return self.conductor.replica_endpoints[0]

    @property
    def registry_address(self) -> str:
        """Where node agents report: the coordinator, or with replicas Envoy's gRPC listener, which picks a live
        replica."""
        if self.coordinator.replicas > 1:
            return self.control_address
        return self.coordinator.replica_endpoints[0]

    @property
    def node_book(self) -> NodeBook:
        """What the coordinator's Registry checks registrations against: which node owns which instance id, the
        hosts of each node, Envoy's own listeners (`coordinator.admission`)."""
        owners: dict[str, set[str]] = {}
        hosts: dict[str, set[str]] = {}
        for agent in self.node_agents:
            node_hosts = hosts.setdefault(agent.node_id, set(agent.hosts))
            listen = split_host_port(agent.listen)[0]
            if not is_wildcard(listen):
                node_hosts.add(listen)
            for engine in agent.engines:
                node_hosts.add(engine.host)
                ids = [engine.instance_id]
                if engine.data_parallel_size > 1 and engine.data_parallel_mode == "external":
                    start = engine.data_parallel_start_rank
                    ids += [f"{engine.instance_id}-dp{r}" for r in range(start, start + engine.local_dp_size)]
                for iid in ids:
                    owners.setdefault(iid, set()).add(agent.node_id)
        envoy = [
            self.envoy.http_listen,
            self.envoy.grpc_listen,
            self.envoy.callback_listen,
        ]  # admin: a unix socket
        envoy += [a for a in (self.envoy.grpc_address, self.coordinator.metaserver_address) if a]
        return NodeBook(
            owners={k: frozenset(v) for k, v in owners.items()},
            hosts={k: frozenset(v) for k, v in hosts.items()},
            envoy_addresses=tuple(envoy),
        )

    def node_agent(self, node_id: str | None) -> NodeAgentConfig:
        """The agent section for `node_id`; the only one when `node_id` is None."""
        if node_id is None:
            if len(self.node_agents) != 1:
                raise ConfigError(
                    f"{self.path}: node_agents has {len(self.node_agents)} entries; pass --node"
                )
            return self.node_agents[0]
        for agent in self.node_agents:
            if agent.node_id == node_id:
                return agent
        raise ConfigError(f"{self.path}: node_agents has no node_id {node_id!r}")


def parse_mesh_config(data: Any, path: str = "<config>") -> MeshConfig:
    """Validates a loaded YAML document; raises ConfigError naming the first bad key. Adapter paths starting with
    `./` or `../` are taken from the mesh file's directory (made absolute: engines and agents check for that)."""
    config = validate(MeshConfig, data, path)
    config.path = path
    base = Path(path).resolve().parent if path != "<config>" else Path.cwd()
    for adapter in [a for m in config.models for a in m.adapters] + [
        a for agent in config.node_agents for e in agent.engines for a in e.adapters
    ]:
        adapter.path = adapter_path_from(base, adapter.path)
    return config


def adapter_path_from(base: Path, path: str) -> str:
    """`path` with a leading `./` or `../` taken from `base`, normalised; any other path as it is (an absolute
    directory, or a Hugging Face hub id `org/name`)."""
    if path.startswith(("./", "../")):
        return os.path.normpath(base / path)
    return path


def load_mesh_config(path: str | Path) -> MeshConfig:
    """Reads and validates the mesh file at `path`."""
    return parse_mesh_config(read_yaml(path), str(path))

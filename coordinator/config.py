"""The `coordinator:` section of the mesh file."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from enum import StrEnum
from typing import Any, Literal, Protocol

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ModelWrapValidatorHandler,
    SerializerFunctionWrapHandler,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_serializer,
    model_validator,
)
from pydantic_core import InitErrorDetails

from coordinator.admission import NodeBook
from coordinator.flow_control import DEFAULT_HEADROOM, DEFAULT_SLOS, DEFAULT_TPOT_HEADROOM, TierSlo
from coordinator.limits import RequestLimits
from coordinator.scheduling import Policy, create_policy, pd_joint, policy_types
from coordinator.scheduling.params import parse_params
from coordinator.scheduling.registry import param_sections, policy_params, section_of
from coordinator.tenants import TenantSpec, Tier, check_unique
from coordinator.topology import PRESETS, Link, NodeLinks, Topology
from tandem.config_file import ConfigError
from tandem.netaddr import (
    Address,
    check_replica_addresses,
    is_wildcard,
    replica_endpoint,
    replica_listen,
    split_host_port,
)

log = logging.getLogger(__name__)


class PdMode(StrEnum):
    """How a model's requests are served (`coordinator.pd_mode`), spelled as the mesh file spells them."""

    #: The setting only, never a request's mode: each model's mode follows its instances' roles and dispatch.
    AUTO = "auto"
    AGGREGATED = "aggregated"  # one hybrid instance serves the whole request
    HANDOFF = "prefill_handoff_decode"  # prefill first, then decode with the prefill's `kv_transfer_params`
    #: Decode first; the decode engine calls the metaserver back to start the prefill (vLLM-Ascend layerwise).
    TRIGGER = "concurrent_engine_sync"


def _migrate_flat_keys(data: dict[Any, Any]) -> dict[Any, Any]:
    """Legacy flat keys (`kv_affinity_load_weight`) moved into their section, with a warning; the nested value wins."""
    flat = [k for k in data if isinstance(k, str) and k.startswith("kv_affinity_")]
    if not flat:
        return data
    data = dict(data)
    nested = dict(data.get("kv_affinity") or {})
    for key in flat:
        param = key[len("kv_affinity_") :]
        value = data.pop(key)
        if param in nested:
            message = (
                f"scheduler.{key} is deprecated and ignored: scheduler.kv_affinity.{param} is set and wins"
            )
        else:
            nested[param] = value
            message = f"scheduler.{key} is deprecated: moved to scheduler.kv_affinity.{param}"
        log.warning(message)
    data["kv_affinity"] = nested
    return data


class PolicySpec(BaseModel):
    """A named policy instance with its parameters (to compare variants side by side)."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1)
    """The name `scheduler.policy` refers to."""
    type: str
    """A built-in policy type."""
    params: dict[str, Any] = {}
    """The type's parameters; defaults fill the rest."""


class SchedulerConfig(BaseModel):
    """How the coordinator picks instances.

    Besides the fields below, one section per built-in policy type that takes parameters (`scheduler.kv_affinity`,
    `scheduler.dynamo`, ...): which sections exist is the policy registry's to say (each policy module declares its
    own, `coordinator.scheduling.interface.PolicyType`), so they are the model's extra keys, checked against the
    registry; any other key is unknown, as in every section. Each holds its type's parameters with the defaults
    filled in (`section`)."""

    # Extra keys are the registry's parameter sections only (`_sections_only`); every other key is refused.
    model_config = ConfigDict(extra="allow")
    __pydantic_extra__: dict[str, dict[str, Any]] = Field(init=False)

    policy: str = "kv_affinity"
    """The policy in use: a built-in type (`round_robin`, `least_load`, `kv_affinity`, ...) or a `policies` name."""
    decode_policy: str = "least_load"
    """The policy choosing decode instances in P/D modes (`policy` chooses hybrid and prefill ones): a built-in type
    or a `policies` name. It sees the decode candidates' loads and, when it asks, the conductor's facts for them."""
    policies: list[PolicySpec] = []
    """Extra named policy instances."""
    match_timeout_ms: float = Field(default=20.0, gt=0)
    """Deadline of one conductor `Match`; past it (or with the conductor down) scoring uses load alone. The
    conductor receives the same deadline and drops a request it could not start in time."""
    predicted_cache_lifetime_ms: float = Field(default=10000.0, ge=0)
    """How long a prompt just routed to an instance counts as cached there (for KV-aware policies) before the
    engine's KV events, through the conductor, confirm it; 0 turns predictions off."""
    prefill_rate_tokens_per_s: float = Field(default=0.0, ge=0)
    """Calibrated prefill speed of one instance, in tokens/s: between two progress reports the ledger drains each
    instance's outstanding prefill at this rate (0: progress reports alone)."""
    pd_choice: Literal["separate", "joint", "adaptive"] = "separate"
    """P/D modes: `separate`: the decode instance by `decode_policy`, then the prefill instance by `policy`, each on
    its own; `joint`: the pair by predicted TTFT, KV transfer over the topology included (`pd_joint`);
    `adaptive`: joint, and a request is served by a decode instance alone when that is predicted sooner."""
    pd_joint: dict[str, Any] = {}
    """Parameters of the joint choice (`coordinator/scheduling/pd_joint.py`); defaults fill the rest."""

    @field_validator("pd_joint")
    @classmethod
    def _pd_joint_params(cls, raw: dict[str, Any]) -> dict[str, Any]:
        return dataclasses.asdict(parse_params(pd_joint.Params, raw, "pd_joint"))

    @model_validator(mode="wrap")
    @classmethod
    def _sections_only(
        cls, data: Any, handler: ModelWrapValidatorHandler[SchedulerConfig]
    ) -> SchedulerConfig:
        """Legacy keys migrated, then any key that is neither a field nor a registered section refused as pydantic
        refuses unknown keys elsewhere (the same error, at the key)."""
        if isinstance(data, dict):
            data = _migrate_flat_keys(data)
            sections = param_sections()
            for key, value in data.items():
                if isinstance(key, str) and key not in cls.model_fields and key not in sections:
                    error = InitErrorDetails(type="extra_forbidden", loc=(key,), input=value)
                    raise ValidationError.from_exception_data(cls.__name__, [error])
        return handler(data)

    @model_serializer(mode="wrap")
    def _sections_after_policy(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """The effective config lists the parameter sections right after the policies they configure."""
        dumped = handler(self)
        head = {k: dumped.pop(k) for k in ("policy", "decode_policy") if k in dumped}
        sections = {k: dumped.pop(k) for k in param_sections() if k in dumped}
        return {**head, **sections, **dumped}

    def section(self, name: str) -> dict[str, Any]:
        """The parameters in section `name`, defaults filled in."""
        return self.__pydantic_extra__[name]

    @model_validator(mode="after")
    def _check_policies(self) -> SchedulerConfig:
        types = policy_types()
        extra = self.__pydantic_extra__
        filled = {s: policy_params(p.name, extra.get(s)) for s, p in param_sections().items()}
        extra.clear()
        extra.update(filled)
        names: set[str] = set()
        for spec in self.policies:
            if spec.name in names or spec.name in types:
                raise ValueError(f"policies: duplicate policy name {spec.name!r}")
            names.add(spec.name)
            if spec.type not in types:
                raise ValueError(
                    f"policies.{spec.name}.type: unknown policy type {spec.type!r} (known: {', '.join(types)})"
                )
            spec.params = policy_params(spec.type, spec.params)
        for key, name in (("policy", self.policy), ("decode_policy", self.decode_policy)):
            if name not in types and name not in names:
                known = ", ".join([*types, *sorted(names)])
                raise ValueError(f"{key}: unknown scheduling policy {name!r} (known: {known})")
        return self

    def build(self) -> Policy:
        """A new instance of the policy in use."""
        return self._build(self.policy)

    def build_decode(self) -> Policy:
        """A new instance of the policy choosing P/D decode instances."""
        return self._build(self.decode_policy)

    def _build(self, name: str) -> Policy:
        for spec in self.policies:
            if spec.name == name:
                return create_policy(spec.type, spec.params)
        section = section_of(name)
        return create_policy(name, self.section(section) if section else None)


class LinkSettings(BaseModel):
    """One kind of link of a node (`coordinator.topology.nodes.<node>.intra` or `.nic`)."""

    model_config = ConfigDict(extra="forbid")

    gbytes_per_s: float = Field(gt=0)
    """Bandwidth in one direction, GB/s (10^9 bytes)."""
    latency_us: float = Field(default=0.0, ge=0)
    """Set-up time of one transfer, microseconds."""

    def build(self) -> Link:
        return Link(self.gbytes_per_s * 1e9, self.latency_us * 1e-6)


class NodeTopology(BaseModel):
    """Where one node sits and its links; what is not set comes from its `preset`."""

    model_config = ConfigDict(extra="forbid")

    preset: Literal["ascend", "gpu"] | None = None
    """The node's hardware links (`coordinator.topology.PRESETS`); `topology.preset` when unset."""
    rack: str = ""
    zone: str = ""
    intra: LinkSettings | None = None
    """Between the node's own accelerators (HCCS, NVLink)."""
    nic: LinkSettings | None = None
    """To other nodes (RoCE, InfiniBand), per accelerator."""


class TopologySettings(BaseModel):
    """`coordinator.topology`: what moving KV between instances costs, for the joint P/D choice."""

    model_config = ConfigDict(extra="forbid")

    preset: Literal["ascend", "gpu"] = "ascend"
    """Links of every node the `nodes` map does not describe."""
    nodes: dict[str, NodeTopology] = {}
    """By node id (the `node_agents[].node_id` of the mesh file)."""

    def build(self) -> Topology:
        """The pure model of these settings."""
        nodes = {}
        for name, node in self.nodes.items():
            base = PRESETS[node.preset or self.preset]
            nodes[name] = NodeLinks(
                intra=node.intra.build() if node.intra else base.intra,
                nic=node.nic.build() if node.nic else base.nic,
                rack=node.rack,
                zone=node.zone,
            )
        return Topology(nodes, PRESETS[self.preset])


class SizingSettings(BaseModel):
    """`coordinator.sizing`: the P:D sizing signal (`coordinator.capacity`, docs/pd.md "Sizing")."""

    model_config = ConfigDict(extra="forbid")

    window_s: float = Field(default=60.0, gt=0)
    """Demand is averaged over this recent window."""
    max_num_seqs: int = Field(default=256, ge=1)
    """The engines' `max_num_seqs`: the largest decode batch counted as capacity."""
    itl_s: float = Field(default=0.0, ge=0)
    """When above 0, the decode batch counted as capacity is also bounded so that a step stays within this
    inter-token latency (your ITL objective); 0: bounded by `max_num_seqs` and KV blocks only."""


class AdapterPlacementSettings(BaseModel):
    """`coordinator.adapters`: how the coordinator loads a LoRA adapter onto the engine it chose for a request that
    does not hold it yet (`coordinator.adapter_placement`, docs/scheduling.md "LoRA adapters")."""

    model_config = ConfigDict(extra="forbid")

    load_timeout_s: float = Field(default=3.0, gt=0)
    """The deadline of one load (`NodeAgent.LoadAdapter` through Envoy's control listener), waiting for a free load
    slot included; the request waits for it and is answered 503 past it. Keep it under Envoy's decision timeout
    (`envoy.ext_proc_timeout_ms`, and ext_authz's) unless the mesh runs ext_proc, whose timer is extended."""
    max_loads_in_flight: int = Field(default=4, ge=1)
    """Loads in flight at once from this coordinator, over every engine (one per engine and adapter always: a
    burst for a cold adapter shares one load)."""
    failed_hold_s: float = Field(default=30.0, gt=0)
    """After a load fails on an instance, that instance is not chosen for the adapter for this long (the others
    still are); the request that asked gets the load's error."""
    loaded_memory_s: float = Field(default=10.0, gt=0)
    """A load this coordinator made counts as resident for this long before the engine's heartbeat lists it (no
    second load for the next request)."""


class EtcdSettings(BaseModel):
    """`coordinator.etcd`: where replicas share the instance registry and drain flags."""

    model_config = ConfigDict(extra="forbid")

    endpoint: Address = "127.0.0.1:2379"
    """An etcd v3 member's client address (`host:port`)."""
    prefix: str = Field(default="/tandem", pattern=r"^/[A-Za-z0-9_./-]*$")
    """Key prefix of this mesh (one etcd can hold several meshes)."""


class TierSloSettings(BaseModel):
    """One tier's SLO and queue (`coordinator.flow_control.<tier>`; docs/scheduling.md)."""

    model_config = ConfigDict(extra="forbid")

    ttft_slo_s: float = Field(gt=0)
    """Predicted time to first token a request of the tier must be able to get for it to go to an engine now."""
    tpot_slo_s: float = Field(gt=0)
    """Predicted time per output token, likewise."""
    max_queued: int = Field(ge=0)
    """Requests of the tier waiting in this coordinator at once; one more is answered 429 (0: never wait)."""
    queue_ttl_s: float = Field(gt=0, le=300)
    """Longest a request of the tier waits; Envoy's decision timeout grows by the largest TTL."""
    admit_on_expiry: bool = False
    """Past the TTL the request goes to an engine anyway (else 429)."""
    refuse_late: bool = True
    """A request whose predicted wait in the queue plus the tier's TTFT threshold exceeds `ttft_slo_s` is answered
    429 at arrival instead of waiting (tiers without `admit_on_expiry`; false: it waits up to the TTL)."""

    def slo(self) -> TierSlo:
        return TierSlo(
            self.ttft_slo_s,
            self.tpot_slo_s,
            self.max_queued,
            self.queue_ttl_s,
            self.admit_on_expiry,
            self.refuse_late,
        )


def _tier_default(tier: Tier) -> TierSloSettings:
    d = DEFAULT_SLOS[tier]
    return TierSloSettings(
        ttft_slo_s=d.ttft_slo_s,
        tpot_slo_s=d.tpot_slo_s,
        max_queued=d.max_queued,
        queue_ttl_s=d.queue_ttl_s,
        admit_on_expiry=d.admit_on_expiry,
        refuse_late=d.refuse_late,
    )


class FlowControlSettings(BaseModel):
    """SLO-aware admission (`coordinator.flow_control`, `coordinator/flow_control.py`): requests no engine can
    serve within their tier's SLO wait in the coordinator, or are answered 429 `rejected: saturated`."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = False
    """Off by default: the SLOs must be chosen for the fleet's hardware and model (the defaults are for an 8B model
    on 910B-class engines), and a held request waits in the coordinator rather than in an engine's queue, with
    Envoy's decision timeout raised by the longest TTL (docs/scheduling.md says how to tune it)."""
    max_queued_total: int = Field(default=1024, ge=1)
    """Requests waiting at once over all tiers (per model, per replica); past it a higher tier displaces a lower."""
    quantum_tokens: int = Field(default=2048, ge=1)
    """Deficit round robin's quantum: tokens of credit a waiting tenant gets per turn."""
    max_retry_after_s: float = Field(default=60.0, gt=0, le=600)
    """Largest `retry-after` a saturated 429 says."""
    headroom: float = Field(default=DEFAULT_HEADROOM, gt=0, le=1)
    """The share of a higher tier's TTFT SLO that lower tiers' admissions may fill (1: all of it): the rest is kept
    free for the higher tier's arrivals during a burst."""
    tpot_headroom: float = Field(default=DEFAULT_TPOT_HEADROOM, gt=0, le=1)
    """The share of a higher tier's TPOT SLO that lower tiers' admissions may fill (1: all of it): the rest is kept
    for the steps their prompts take from its decoding requests."""
    priority: TierSloSettings = _tier_default(Tier.PRIORITY)
    default: TierSloSettings = _tier_default(Tier.DEFAULT)
    flex: TierSloSettings = _tier_default(Tier.FLEX)

    @field_validator("priority", "default", "flex", mode="before")
    @classmethod
    def _tier_defaults(cls, value: Any, info: ValidationInfo) -> Any:
        """A tier's keys left out keep that tier's defaults (`flex: {queue_ttl_s: 60}` changes the TTL only)."""
        if isinstance(value, dict):
            return {**_tier_default(Tier(info.field_name or "")).model_dump(), **value}
        return value

    def slos(self) -> dict[Tier, TierSlo]:
        return {tier: getattr(self, tier.value).slo() for tier in Tier}

    @property
    def max_wait_s(self) -> float:
        """The longest a request may wait in the queue (0 when off): Envoy's decision timeout adds it."""
        if not self.enabled:
            return 0.0
        return max(getattr(self, tier.value).queue_ttl_s for tier in Tier)


class CoordinatorConfig(BaseModel):
    """The coordinator process: ext_proc endpoint picker, Registry, Admin and Metaserver on one gRPC port."""

    model_config = ConfigDict(extra="forbid")

    listen: Address = "127.0.0.1:9100"
    """gRPC address (ext_proc for Envoy, Registry for agents, Admin and Metaserver through Envoy's :9000)."""
    metrics_listen: Address = "127.0.0.1:9101"
    """Prometheus `/metrics` address."""
    relearn_s: float = Field(default=3.0, ge=0)
    """For this long after the coordinator starts, a request whose model has no routable instance yet waits for the
    node agents to register again (they reconnect within a second) and is decided then, instead of getting 503: a
    restarted coordinator fails no request for want of the instances it has not relearnt yet. 0: answer at once."""
    heartbeat_interval_s: float = Field(default=2.0, gt=0)
    """How often agents report (health changes are reported at once, not at the next interval)."""
    instance_ttl_s: float | None = Field(default=None, gt=0)
    """An instance whose agent has been silent this long is marked unhealthy (its lease). Engines outlive their
    agent: the lease is what lets an agent restart (and re-register its engines) without the engines leaving the
    routing table. Three heartbeat intervals when unset."""

    @property
    def instance_ttl(self) -> float:
        """`instance_ttl_s`, or three heartbeat intervals."""
        return self.instance_ttl_s or 3 * self.heartbeat_interval_s

    instance_removal_s: float | None = Field(default=None, gt=0)
    """An instance whose agent has been silent this long is removed from the registry and its id released (another
    registration may take it). Ten `instance_ttl`s when unset (60 s with the default heartbeats); with `etcd`, the
    lease (`instance_ttl`) removes it from the shared store sooner."""

    @property
    def instance_removal(self) -> float:
        """`instance_removal_s`, or ten `instance_ttl`s."""
        return self.instance_removal_s or 10 * self.instance_ttl

    probe_instances: bool = True
    """A newly registered instance becomes routable only after it answers `GET /health` from the coordinator (the
    agent's word is not enough: a compromised node could register addresses where nothing answers)."""
    max_instances_per_node: int = Field(default=128, ge=1)
    """Instances one node's agent may have registered at once (DP ranks count one each); more is refused with
    RESOURCE_EXHAUSTED."""
    default_max_tokens: int = Field(default=16, gt=0)
    """Output tokens counted for a completions request without `max_tokens` (vLLM's default is 16)."""
    chat_default_max_tokens: int = Field(default=256, gt=0)
    """Output tokens counted for a chat request without `max_tokens`/`max_completion_tokens`."""
    pd_mode: PdMode = PdMode.AUTO
    """`aggregated`: hybrid instances only. `prefill_handoff_decode`: prefill first, then decode with the
    prefill's `kv_transfer_params`. `concurrent_engine_sync`: decode first; the decode engine calls the metaserver
    back to start the prefill (vLLM-Ascend layerwise). `auto`: P/D when the model has prefill or decode instances
    (handoff or trigger by their dispatch capability), else aggregated."""
    replica: str = Field(default="c0", pattern=r"^[A-Za-z0-9_-]+$")
    """This coordinator process's name in metaserver callback URLs (`/v1/metaserver/<replica>`)."""
    replicas: int = Field(default=1, ge=1)
    """Coordinator processes (active-active behind Envoy). Replica i is `c<i>`; on one host it listens on `listen`
    and `metrics_listen` with the port + 10 * i (see `replica_addresses`); more than one needs `etcd`."""
    replica_addresses: list[Address] = []
    """Replicas on different hosts (e.g. Kubernetes StatefulSet pods): where replica i is reached, one `host:port`
    (an address or a DNS name) per replica. Each replica then binds `listen` itself (a wildcard such as
    `0.0.0.0:9100` is allowed) and no port is shifted. Empty: replicas on one host."""
    etcd: EtcdSettings | None = None
    """Shared state of the replicas (instances as leases, drain flags); without it the coordinator keeps its state
    in memory (one replica)."""
    metaserver_address: str | None = None
    """`host:port` decode engines reach the metaserver at (Envoy's callback listener, which transcodes the
    callback); `envoy.callback_listen` when unset. Never a wildcard; bracket IPv6 literals."""
    prefill_attempts: int = Field(default=2, ge=1)
    """Prefill instances tried for one request in handoff mode before answering 503."""
    prefill_timeout_s: float = Field(default=120.0, gt=0)
    """Longest prefill leg; past it the leg counts as failed."""
    scheduler: SchedulerConfig = SchedulerConfig()
    """Scheduling policy."""
    topology: TopologySettings = TopologySettings()
    """Nodes' places and KV transfer links (the joint P/D choice, `scheduler.pd_choice`)."""
    sizing: SizingSettings = SizingSettings()
    """The P:D sizing signal: utilisation per role and a suggested split, on `/metrics` and `Admin/GetStats`."""
    adapters: AdapterPlacementSettings = AdapterPlacementSettings()
    """LoRA adapter placement: loads onto the chosen engine, their bounds and the hold after a failed one."""
    ticket_lifetime_s: float = Field(default=3600.0, gt=0)
    """Longest a routed request holds its workload when Envoy's access log never reports its end (the log is
    at-most-once); make it longer than the longest response."""
    reconcile_grace_s: float = Field(default=2.0, gt=0)
    """A request whose end may have been lost (the access log stream was down) is released once its engines
    report nothing running or waiting in a sample taken this long after it was routed."""
    decision_inline_bytes: int = Field(default=8192, ge=0)
    """Bodies up to this size are parsed and tokenized on the event loop; larger ones in worker processes, so
    that one huge prompt does not stall the decisions of others."""
    recent_decisions: int = Field(default=256, ge=0)
    """Routing decisions kept, with every candidate's score components, for `Admin/ListDecisions` and `tandem top`
    (the oldest pushed out; 0: none kept)."""
    decision_processes: int = Field(default=1, ge=0)
    """Worker processes parsing and tokenizing large bodies (0: every body on the event loop)."""
    limits: RequestLimits = RequestLimits()
    """The largest request accepted (`max_tokens`, `n`, prompts, JSON depth); larger is answered 400."""
    flow_control: FlowControlSettings = FlowControlSettings()
    """SLO-aware admission: per tier an SLO and a bounded queue in the coordinator (docs/scheduling.md)."""
    callback_kv_hosts: list[str] = []
    """Trigger mode: addresses or networks (CIDR) a decode engine's callback may name as `remote_host` besides the
    decode instance's own host (for KV transfer NICs other than the HTTP address)."""
    api_keys_file: str | None = None
    """API keys of the OpenAI port, one per line (`#` comments). With keys (here or in `api_keys_env`), every
    `/v1/` request needs `Authorization: Bearer <key>`, else 401; the header is not forwarded to engines."""
    api_keys_env: str | None = None
    """The name of an environment variable holding API keys, comma-separated."""
    tenants: list[TenantSpec] = []
    """Tenants: API keys with a default and a highest service tier and quotas (docs/scheduling.md). Their keys are
    accepted keys of the OpenAI port: with any tenant, every `/v1/` request needs a key."""
    tenants_file: str | None = None
    """More tenants, in a YAML file (`tenants: [...]`, entries as in `tenants`), read again whenever its content
    changes; a malformed file is logged in one line and the tenants last read from it are kept."""
    engine_priority: bool = False
    """The engines run with vLLM's `--scheduling-policy priority`: each request carries its tier as vLLM's
    `priority` field (priority -1, default 0, flex 1; smaller is served first). Needs the ext_proc decision path
    (it rewrites the body); vLLM refuses a non-zero `priority` without that policy, so leave it off otherwise."""

    @field_validator("tenants")
    @classmethod
    def _unique_tenants(cls, value: list[TenantSpec]) -> list[TenantSpec]:
        try:
            return check_unique(value, "tenants")
        except ConfigError as exc:  # reported by pydantic at the key
            raise ValueError(str(exc).partition(": ")[2]) from None

    @field_validator("metaserver_address")
    @classmethod
    def _advertised(cls, value: str | None) -> str | None:
        if value is not None and is_wildcard(split_host_port(value)[0]):
            raise ValueError(f"{value!r} is a wildcard address; decode engines need one they can reach")
        return value

    @model_validator(mode="after")
    def _replicas_share_state(self) -> CoordinatorConfig:
        if self.replicas > 1 and self.etcd is None:
            raise ValueError(
                "etcd: required when replicas > 1 (the replicas share their instances through it)"
            )
        check_replica_addresses(self.listen, self.replicas, self.replica_addresses)
        return self

    def replica_config(self, index: int) -> CoordinatorConfig:
        """The section as replica `index` runs it: its name and, for replicas on one host, its ports (+10 each)."""
        if not 0 <= index < self.replicas:
            raise ValueError(f"replica {index} out of range: replicas is {self.replicas}")
        update: dict[str, object] = {"replica": f"c{index}"}
        if not self.replica_addresses:
            update["listen"] = replica_listen(self.listen, index)
            update["metrics_listen"] = replica_listen(self.metrics_listen, index)
        return self.model_copy(update=update)

    @property
    def replica_endpoints(self) -> list[str]:
        """Where every replica's gRPC server is reached."""
        return [replica_endpoint(self.listen, i, self.replica_addresses) for i in range(self.replicas)]

    @property
    def prefill_budget_s(self) -> float:
        """The longest the coordinator may hold a request while prefill legs run (Envoy's message timer)."""
        return self.prefill_timeout_s * self.prefill_attempts + 5.0


class _Adapter(Protocol):
    @property
    def name(self) -> str: ...
    @property
    def path(self) -> str: ...


class _Model(Protocol):
    @property
    def name(self) -> str: ...
    @property
    def adapters(self) -> Sequence[_Adapter]: ...
    @property
    def tokenizer(self) -> str | None: ...
    @property
    def max_model_len(self) -> int | None: ...


class _Replicated(Protocol):
    @property
    def replica_endpoints(self) -> list[str]: ...


class MeshView(Protocol):
    """What the coordinator reads of the mesh file. `mesh.config.MeshConfig` provides it: the layer above composes
    the file and hands it down, so the coordinator imports neither that layer nor the other components."""

    @property
    def path(self) -> str:
        """The file the config came from ("" when built in code): watched for scheduler reloads."""
        ...

    @property
    def coordinator(self) -> CoordinatorConfig:
        """This process's section; its `scheduler` is replaced on reload."""
        ...

    @property
    def conductor(self) -> _Replicated:
        """Where the conductor's replicas are reached."""
        ...

    @property
    def models(self) -> Sequence[_Model]:
        """The models the mesh serves, with their tokenizers."""
        ...

    @property
    def request_end_lag_s(self) -> float:
        """How late a request's end can reach the coordinator after its client got the answer."""
        ...

    @property
    def metaserver_url(self) -> str:
        """The callback URL decode engines get in trigger mode."""
        ...

    @property
    def destination_fallback(self) -> bool:
        """Whether Envoy's engines cluster takes a second, fallback engine in the destination (`static`)."""
        ...

    @property
    def decision_timeout_s(self) -> float:
        """How long Envoy waits for one decision reply (`envoy.ext_proc_timeout_ms`)."""
        ...

    @property
    def conductor_match_address(self) -> str:
        """Where the Match stream goes: the conductor, or Envoy's gRPC listener in front of its replicas."""
        ...

    @property
    def control_address(self) -> str:
        """Envoy's control listener, through which the coordinator calls a node's agent (`tandem-node` header)."""
        ...

    @property
    def node_book(self) -> NodeBook:
        """What the file says about nodes: instance owners, node hosts, Envoy's listeners (`coordinator.admission`)."""
        ...

    def model_dump(self, *, mode: Any = ..., exclude: Any = ...) -> dict[str, Any]:
        """The whole effective config (Admin/GetConfig, reload comparisons)."""
        ...

"""The `node_agents:` entries of the mesh file: one per node, with the engines and services it runs.

Engine keys follow vLLM's own names (`tensor_parallel_size` is `--tensor-parallel-size`, ...) so that a reader of
a `vllm serve` script finds them; `tandem import-vllm` writes this section from such a script.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from node_agent.backends.registry import get_backend
from tandem.netaddr import Address, is_wildcard

# KV connectors by what they mean for dispatch (vLLM `KVConnectorFactory` names and vLLM-Ascend's registrations in
# vllm_ascend/distributed/kv_transfer/__init__.py: MooncakeConnectorV1, MooncakeHybridConnector,
# MooncakeLayerwiseConnector). Layerwise means the decode engine calls the metaserver back (trigger).
TRIGGER_CONNECTORS = frozenset({"MooncakeLayerwiseConnector"})
HANDOFF_CONNECTORS = frozenset(
    {
        "MooncakeConnectorV1",  # vLLM-Ascend
        "MooncakeHybridConnector",  # vLLM-Ascend
        "MooncakeConnector",  # vLLM
        "NixlConnector",  # vLLM
        "P2pNcclConnector",  # vLLM
        "ExampleConnector",  # vLLM, formerly SharedStorageConnector: P/D on the CPU through a shared directory
        "SharedStorageConnector",
    }
)
# Connectors whose `kv_connector_extra_config` carries both sides' topology as `prefill`/`decode` maps of
# `dp_size`/`tp_size`/`pp_size` (vLLM-Ascend docs: tutorials/features/pd_disaggregation_mooncake_multi_node.md,
# user_guide/feature_guide/pipeline_parallel.md "PP in P/D-Disaggregated Serving").
MOONCAKE_TOPOLOGY_CONNECTORS = frozenset(
    {"MooncakeConnectorV1", "MooncakeHybridConnector", "MooncakeLayerwiseConnector"}
)
KV_ROLES = {"prefill": "kv_producer", "decode": "kv_consumer", "hybrid": "kv_both"}


def _placeholder(value: Any) -> Any:
    """`"${NODE_RANK}"`-style strings (and empty strings) mean "injected at run time": stored as None."""
    if isinstance(value, str) and (not value.strip() or value.strip().startswith("$")):
        return None
    return value


class RestartPolicy(BaseModel):
    """How a crashed engine is restarted (`tandem.restarts`): exponential backoff, then give up after a crash loop
    (left FAILED until `NodeAgent.Launch`)."""

    model_config = ConfigDict(extra="forbid")

    initial_backoff_s: float = Field(default=1.0, gt=0)
    """Delay before the first restart."""
    max_backoff_s: float = Field(default=30.0, gt=0)
    """The delay doubles per consecutive crash up to this."""
    max_consecutive_failures: int = Field(default=5, ge=1)
    """Crashes in a row (each before `stable_after_s`) after which the engine is left FAILED."""
    stable_after_s: float = Field(default=60.0, gt=0)
    """A run at least this long resets the crash count and the backoff."""

    @property
    def first_restart_s(self) -> float:
        """The first restart of an engine waits `initial_backoff_s` too (`tandem.restarts.BackoffPolicy`): a crashed
        engine may still hold its accelerator's memory or its port for a moment."""
        return self.initial_backoff_s

    @property
    def failed_after(self) -> int:
        """The tracker's name for `max_consecutive_failures` (`tandem.restarts.BackoffPolicy`)."""
        return self.max_consecutive_failures


#: vLLM's `--max-lora-rank` values (vllm/config/lora.py `MaxLoRARanks`).
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
#: vLLM's defaults: `--max-lora-rank` 16, `--max-loras` 1.
DEFAULT_LORA_RANK = 16
DEFAULT_MAX_LORAS = 1


class LoraAdapterConfig(BaseModel):
    """A LoRA adapter of a model (`models[].adapters`): loaded into every engine serving the model through vLLM's
    `/v1/load_lora_adapter` once the engine is healthy, and served to requests whose `model` is its name."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1)
    """The name clients send as `model` (vLLM's `lora_name`); distinct from every model's name."""
    path: str = Field(min_length=1)
    """Where the engine reads the adapter (`lora_path`): a directory on the engine's node holding PEFT's
    `adapter_config.json` and weights, or a Hugging Face hub id the engine downloads (unless offline)."""
    max_rank: int | None = Field(default=None, gt=0)
    """The adapter's rank (`r` of its `adapter_config.json`) when above vLLM's default 16: the engine's
    `--max-lora-rank` is raised to the smallest vLLM value that fits the largest adapter (at most 512)."""
    preload: bool = True
    """Loaded into every engine serving the model at its start. False: loaded on demand only, by the coordinator,
    onto the engine it chooses for the adapter's first request (`NodeAgent.LoadAdapter`); the engine's launch
    flags still count it."""

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        bad = [c for c in value if c.isspace() or c in ",="]
        if bad:
            raise ValueError(
                f"{value!r}: an adapter name cannot contain {bad[0]!r} (vLLM joins adapter names with commas "
                "in its metrics)"
            )
        return value

    @field_validator("max_rank")
    @classmethod
    def _rank(cls, value: int | None) -> int | None:
        if value is not None and value > LORA_RANKS[-1]:
            raise ValueError(f"{value} is above vLLM's largest --max-lora-rank {LORA_RANKS[-1]}")
        return value


def lora_rank_for(adapters: list[LoraAdapterConfig]) -> int:
    """`--max-lora-rank`: the smallest vLLM value at or above every adapter's `max_rank` (16 when none says)."""
    need = max([a.max_rank or DEFAULT_LORA_RANK for a in adapters], default=DEFAULT_LORA_RANK)
    return next(r for r in LORA_RANKS if r >= need)


class EngineConfig(BaseModel):
    """One engine instance the agent launches and supervises (one process per local DP rank in external LB)."""

    model_config = ConfigDict(extra="forbid")

    instance_id: str = Field(min_length=1)
    """Unique id across the mesh; DP ranks in external load balancing register as `<instance_id>-dp<rank>`."""
    backend: str = "simengine"
    """What to launch: a registered backend (`node_agent.backends`: simengine, vllm, vllm-ascend)."""
    model: str = Field(min_length=1)
    """The served model name (`--served-model-name`)."""
    model_path: str | None = None
    """Weights directory or hub id passed to vLLM (required for `vllm` and `vllm-ascend`); simengine needs none."""
    python: str | None = None
    """Interpreter that runs the engine (`simengine`, `vllm`; for `vllm-ascend` it replaces the `vllm` script with
    `python -m vllm.entrypoints.cli.main`). The agent's own interpreter when unset (`vllm-ascend`: `vllm` on PATH)."""
    tokenizer: str | None = None
    """Tokenizer directory for simengine (`--tokenizer`); the built-in tokenizer when unset."""
    host: str = "127.0.0.1"
    """Address the engine listens on and is reached at (never a wildcard)."""
    port: int = Field(gt=0, lt=65536)
    """The engine's HTTP port; local DP rank i of an external-LB engine listens on `port + i`."""
    role: Literal["hybrid", "prefill", "decode"] = "hybrid"
    """The engine's part in serving; sets `kv_role` (prefill: kv_producer, decode: kv_consumer, hybrid: kv_both)."""
    block_size: int = Field(default=0, ge=0)
    """KV block size (`--block-size`, always passed so that engine and conductor agree); the backend's default when
    unset: simengine 16, vllm 32 (the CPU backend needs a multiple of 32), vllm-ascend 128 (its default)."""

    tensor_parallel_size: int = Field(default=1, ge=1)
    """`--tensor-parallel-size`."""
    pipeline_parallel_size: int = Field(default=1, ge=1)
    """`--pipeline-parallel-size`."""
    prefill_context_parallel_size: int = Field(default=1, ge=1)
    """`--prefill-context-parallel-size` (pcp); part of the world size of one DP rank."""
    data_parallel_size: int = Field(default=1, ge=1)
    """`--data-parallel-size`: DP ranks of the whole engine, over every node."""
    data_parallel_size_local: int | None = Field(default=None, ge=1)
    """DP ranks on this node (`--data-parallel-size-local`); all of them when unset."""
    data_parallel_start_rank: int = Field(default=0, ge=0)
    """First DP rank on this node (`--data-parallel-start-rank` in internal LB; ranks counted from it otherwise)."""
    data_parallel_mode: Literal["external", "internal"] = "external"
    """external: one API server per DP rank (`--data-parallel-rank`), each registered on its own port (what
    vLLM-Ascend P/D deployments use; vLLM supports it for MoE models). internal: one API server balancing its ranks."""
    data_parallel_address: str | None = None
    """`--data-parallel-address` (the DP head node); `master_addr`, else this engine's host, when unset."""
    data_parallel_rpc_port: int | None = Field(default=None, gt=0, lt=65536)
    """`--data-parallel-rpc-port`; passed only when set."""
    nnodes: int = Field(default=1, ge=1)
    """Nodes one DP rank spans (`--nnodes`, multiprocessing backend); node rank > 0 runs `--headless`."""
    node_rank: int | None = Field(default=None, ge=0)
    """`--node-rank`; a placeholder (unset or `"${NODE_RANK}"`) is filled at run time (`--node-rank`,
    `TANDEM_NODE_RANK`), which always wins."""
    master_addr: str | None = None
    """`--master-addr` of a cross-node engine; injected at run time like `node_rank` (`TANDEM_MASTER_ADDR`)."""
    master_port: int | None = Field(default=None, gt=0, lt=65536)
    """`--master-port` of a cross-node engine (vLLM's default 29501 when unset)."""
    devices: list[int] | None = None
    """Accelerator ids of this node for the engine: each local process gets `(pcp*tp*pp)/nnodes` of them, in order
    (`ASCEND_RT_VISIBLE_DEVICES` for vllm-ascend). All devices are visible when unset."""

    kv_connector: str | None = None
    """`kv_transfer_config.kv_connector` (MooncakeConnectorV1, MooncakeLayerwiseConnector, ExampleConnector, ...)."""
    kv_port: int | None = Field(default=None, gt=0, lt=65536)
    """`kv_transfer_config.kv_port` (vLLM-Ascend adds `dp_rank * pcp * tp` per rank itself)."""
    kv_connector_extra_config: dict[str, Any] = {}
    """`kv_transfer_config.kv_connector_extra_config`: the user's fields are kept; for Mooncake connectors this
    engine's side (`prefill` or `decode`) gets its `dp_size`/`tp_size`/`pp_size` filled in."""
    kv_transfer_config: dict[str, Any] = {}
    """Further `--kv-transfer-config` fields (kv_buffer_device, kv_connector_module_path, ...). The address the
    engine's KV listener binds and announces to its peer is the engine's `host`, passed as vLLM reads it, in
    `VLLM_NIXL_SIDE_CHANNEL_HOST`; set that in `env` for a KV NIC other than the HTTP address (and list it in
    `coordinator.callback_kv_hosts` too)."""
    kv_events: bool = True
    """Publish KV events and relay them to the conductor."""
    kv_events_port: int | None = Field(default=None, gt=0, lt=65536)
    """TCP base port of the KV event publisher (the engine binds `port + dp_rank`, replay on
    `port + data_parallel_size + dp_rank`). Needed with DP ranks: vLLM offsets only tcp endpoints per rank and
    rejects ipc ones (vllm/distributed/kv_events.py `offset_endpoint_port`). IPC sockets when unset."""
    adapters: list[LoraAdapterConfig] = []
    """LoRA adapters the agent loads into the engine; the model's (`models[].adapters` of the mesh file) when
    unset. With adapters (or `max_loras`) the engine is launched with `--enable-lora`, `--max-loras`,
    `--max-lora-rank`, `--max-cpu-loras` and `VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`."""
    max_loras: int | None = Field(default=None, ge=1)
    """Adapters one engine step may run at once (`--max-loras`; requests of further adapters wait): the model's
    `max_loras` when unset, else vLLM's default 1. Setting it enables LoRA even without configured adapters
    (adapters loaded later through `NodeAgent.LoadAdapter`)."""
    args: list[str] = []
    """Extra arguments appended to the launch command."""
    env: dict[str, str] = {}
    """Extra environment variables of the engine process."""
    health_timeout_s: float = Field(default=300.0, gt=0)
    """How long a starting engine may take to answer `/health`."""
    drain_timeout_s: float = Field(default=300.0, gt=0)
    """How long `NodeAgent.Drain` waits for requests in flight before stopping the engine anyway."""

    @field_validator("node_rank", "master_addr", mode="before")
    @classmethod
    def _injected(cls, value: Any) -> Any:
        return _placeholder(value)

    @field_validator("backend")
    @classmethod
    def _backend(cls, value: str) -> str:
        get_backend(value)  # an unknown name is a ValueError listing the known ones
        return value

    @field_validator("host")
    @classmethod
    def _host(cls, value: str) -> str:
        if is_wildcard(value):
            raise ValueError("a wildcard address cannot be reached; give the engine's own address")
        return value

    @model_validator(mode="after")
    def _check(self) -> EngineConfig:
        me = f"engine {self.instance_id!r}"
        backend = get_backend(self.backend)
        if not self.block_size:
            self.block_size = backend.default_block_size
        if backend.needs_model_path and not self.model_path:
            raise ValueError(f"{me}: model_path is required for backend {self.backend!r}")
        if self.role != "hybrid" and self.kv_connector is None and backend.pd_needs_connector:
            raise ValueError(f"{me}: role {self.role!r} needs kv_connector (a P/D connector)")
        if self.role != "hybrid" and self.kv_connector and not is_pd_connector(self.kv_connector):
            raise ValueError(
                f"{me}: kv_connector {self.kv_connector!r} is not a P/D connector (role {self.role!r})"
            )
        local = self.local_dp_size
        if self.data_parallel_start_rank + local > self.data_parallel_size:
            raise ValueError(
                f"{me}: data_parallel_start_rank {self.data_parallel_start_rank} + data_parallel_size_local "
                f"{local} exceeds data_parallel_size {self.data_parallel_size}"
            )
        if self.nnodes > 1 and self.data_parallel_size > 1:
            raise ValueError(
                f"{me}: nnodes > 1 with data_parallel_size > 1 is not supported; spread DP ranks over nodes with "
                "data_parallel_size_local and data_parallel_start_rank instead"
            )
        if self.world_size % self.nnodes:
            raise ValueError(
                f"{me}: nnodes {self.nnodes} does not divide the world size of a DP rank "
                f"(prefill_context_parallel_size {self.prefill_context_parallel_size} x tensor_parallel_size "
                f"{self.tensor_parallel_size} x pipeline_parallel_size {self.pipeline_parallel_size} = "
                f"{self.world_size})"
            )
        if self.node_rank is not None and self.node_rank >= self.nnodes:
            raise ValueError(f"{me}: node_rank {self.node_rank} must be below nnodes {self.nnodes}")
        if self.devices is not None:
            need = self.local_world_size * local
            if len(self.devices) < need:
                raise ValueError(
                    f"{me}: devices lists {len(self.devices)} ids, the engine needs {need} on this node "
                    f"({local} local DP rank(s) x {self.local_world_size} devices)"
                )
            if len(set(self.devices)) != len(self.devices):
                raise ValueError(f"{me}: devices has duplicates")
        if self.kv_events and self.data_parallel_size > 1 and self.kv_events_port is None:
            raise ValueError(
                f"{me}: kv_events_port is required with data_parallel_size > 1 (vLLM offsets only tcp KV event "
                "endpoints per DP rank); or set kv_events: false"
            )
        extra_sides = {k for k in ("prefill", "decode") if k in self.kv_connector_extra_config}
        for side in extra_sides:
            if not isinstance(self.kv_connector_extra_config[side], dict):
                raise ValueError(f"{me}: kv_connector_extra_config.{side} must be a mapping")
        own = self.kv_connector_extra_config.get(self.role)
        if isinstance(own, dict):
            sizes = {"dp_size": self.data_parallel_size, "tp_size": self.tensor_parallel_size,
                     "pp_size": self.pipeline_parallel_size}  # fmt: skip
            for key, value in sizes.items():
                if key in own and own[key] != value:
                    raise ValueError(
                        f"{me}: kv_connector_extra_config.{self.role}.{key} is {own[key]} but the engine's own "
                        f"size is {value}; drop the key (it is filled in) or fix the parallel sizes"
                    )
        if self.kv_connector in MOONCAKE_TOPOLOGY_CONNECTORS - TRIGGER_CONNECTORS and self.role != "hybrid":
            peer = "decode" if self.role == "prefill" else "prefill"
            given = self.kv_connector_extra_config.get(peer) or {}
            missing = [k for k in ("dp_size", "tp_size") if k not in given]
            if missing:
                raise ValueError(
                    f"{me}: kv_connector_extra_config.{peer}.{missing[0]} is required: {self.kv_connector} needs the "
                    f"{peer} side's topology (vllm_ascend mooncake_connector asserts dp_size and tp_size on both sides)"
                )
        for key in ("kv_connector", "kv_role", "engine_id", "kv_port", "kv_connector_extra_config"):
            if key in self.kv_transfer_config:
                raise ValueError(f"{me}: kv_transfer_config.{key} is set by its own key or by the agent")
        names = [a.name for a in self.adapters]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"{me}: adapters: duplicate name {dupes[0]!r}")
        if self.model in names:
            raise ValueError(f"{me}: adapters: {self.model!r} is the engine's model name, not an adapter's")
        lora_flags = ("--enable-lora", "--max-loras", "--max-lora-rank", "--max-cpu-loras", "--lora-modules")
        given = [a for a in self.args if a.split("=", 1)[0] in lora_flags]
        if given:
            raise ValueError(f"{me}: args: {given[0]} is set by the agent from adapters and max_loras")
        return self

    @property
    def lora_enabled(self) -> bool:
        """The engine serves LoRA adapters: some are configured, or `max_loras` is set."""
        return bool(self.adapters) or self.max_loras is not None

    @property
    def lora_slots(self) -> int:
        """`--max-loras`."""
        return self.max_loras or DEFAULT_MAX_LORAS

    @property
    def world_size(self) -> int:
        """Devices of one DP rank: pcp * tp * pp (vLLM `ParallelConfig`, world size within DP)."""
        return self.prefill_context_parallel_size * self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def local_world_size(self) -> int:
        """Devices of one DP rank on this node: world size // nnodes (checked divisible)."""
        return self.world_size // self.nnodes

    @property
    def local_dp_size(self) -> int:
        """DP ranks on this node."""
        if self.data_parallel_size_local is not None:
            return self.data_parallel_size_local
        return self.data_parallel_size - self.data_parallel_start_rank

    @property
    def kv_role(self) -> str:
        """vLLM `kv_role` from the role."""
        return KV_ROLES[self.role]


def is_pd_connector(name: str) -> bool:
    """True for connectors that move KV between a prefill and a decode engine."""
    return name in TRIGGER_CONNECTORS or name in HANDOFF_CONNECTORS


class KvStoreConfig(BaseModel):
    """A KV store process run beside (combined) or instead of (separated) the engines, e.g. Mooncake's master."""

    model_config = ConfigDict(extra="forbid")

    mode: Literal["combined", "separated"] = "combined"
    """combined: the store and this node's engines; separated: the store only (no engine, no registration)."""
    argv: list[str] = Field(default_factory=lambda: ["mooncake_master", "--port", "50088"])
    """The store's command line (an argument list, never a shell string)."""
    env: dict[str, str] = {}
    """Extra environment of the store process."""
    health_address: Address | None = "127.0.0.1:50088"
    """`host:port` that accepts TCP connections once the store is up; the process being alive when unset."""
    engine_env: dict[str, str] = {}
    """Environment added to every engine of the node in combined mode (e.g. `MOONCAKE_CONFIG_PATH`)."""
    health_timeout_s: float = Field(default=60.0, gt=0)
    """How long the store may take to accept connections before engines start anyway and it is restarted."""


SERVICES = ("engine", "kv_store")


class NodeAgentConfig(BaseModel):
    """A node agent: its own gRPC address, where the control plane is, and its engines."""

    model_config = ConfigDict(extra="forbid")

    node_id: str = Field(min_length=1)
    """This node's id (appears in every instance it registers)."""
    listen: Address = "127.0.0.1:9300"
    """The agent's gRPC address (NodeAgent service)."""
    metrics_listen: Address = "127.0.0.1:9301"
    """Prometheus `/metrics` address."""
    coordinator_address: str | None = None
    """Coordinator gRPC address; the mesh file's `coordinator.listen` when unset."""
    conductor_address: str | None = None
    """Conductor gRPC address; the mesh file's `conductor.listen` when unset."""
    runtime_dir: str | None = None
    """Where engine logs and IPC sockets go; `/tmp/tandem-<node_id>-<listen port>` when unset."""
    state_dir: str | None = None
    """Where the agent records the processes it launched (pid, start time, launch), so that a restarted agent adopts
    them instead of restarting them; `<runtime_dir>/state` when unset."""
    probe_interval_s: float = Field(default=0.5, gt=0)
    """How often each engine's `/health` is probed (an idle one: `idle_probe_interval_s`)."""
    idle_probe_interval_s: float = Field(default=2.0, gt=0)
    """How often an idle, healthy engine's `/health` is probed (idle as for `idle_load_interval_s`; engines with
    `kv_events: false` are always probed every `probe_interval_s`). Probing follows need: an idle engine has no other
    sign of life, but four probes a second were most of what an idle engine and its agent cost. The price: a freeze
    of an idle engine is seen within `idle_probe_interval_s + probe_timeout_s` (3 s) rather than 1.5 s. An engine
    that starts to work (its KV events) or fails a probe is probed every `probe_interval_s` again at once."""
    probe_timeout_s: float = Field(default=1.0, gt=0)
    """A `/health` (or `/metrics`) read that takes longer fails: a hung engine is reported unhealthy within
    `probe_interval_s + probe_timeout_s`."""
    liveness_timeout_s: float | None = Field(default=3.0, gt=0)
    """A running engine that has answered no health probe for this long, nor two in a row (the first probe after the
    agent itself was frozen fails on its own account), is killed (SIGKILL: a frozen process takes no SIGTERM) and
    restarted like a crash: its connections close, so the requests on it end at once (an error, or
    Envoy's retry on another engine, before the first byte; a cut stream after it) instead of hanging until it
    thaws. Liveness, not a request timeout: long prefills and queued requests keep running on an engine that
    answers `/health`. Raise it for engines whose health endpoint can stall under load; null: never killed (a hung
    engine is then only reported UNRESPONSIVE and not routed to)."""
    load_interval_s: float = Field(default=0.25, gt=0)
    """How often each healthy engine's `/metrics` is read while it works, and its load and progress counters relayed
    to the coordinator (the coordinator takes finished prefills off its workload ledger from them: a few Hz)."""
    idle_load_interval_s: float = Field(default=5.0, gt=0)
    """How often an idle engine's `/metrics` is read: one whose last read showed nothing running or waiting and no
    progress since the read before. A read costs a vLLM engine a few ms of CPU (its page is mostly histograms):
    four a second cost an idle engine more than everything else it does. An idle engine is read again at once when
    it publishes KV events (work has begun), and at `load_interval_s` while a read shows work, so this bounds only how
    late the coordinator learns of work that stores no new blocks (a fully cached prompt with a short answer) and how
    old an idle engine's load figures get. Engines with `kv_events: false` are always read at `load_interval_s`.
    A read is relayed to the coordinator at once only when it says something new; its regular heartbeats carry the
    latest read."""
    stop_grace_s: float = Field(default=10.0, gt=0)
    """Seconds between SIGTERM and SIGKILL when stopping an engine."""
    restart: RestartPolicy = RestartPolicy()
    """Restart policy of crashed engines (and the KV store)."""
    services: str = "engine"
    """Comma-separated local services to run: `engine`, `kv_store`, or both (`engine,kv_store`)."""
    kv_store: KvStoreConfig | None = None
    """The KV store service (required when `services` names `kv_store`)."""
    engines: list[EngineConfig] = []
    """The engines of this node."""
    hosts: list[str] = []
    """Further hosts (addresses or names) this node's instances may be registered at, besides its engines' `host`
    and its `listen` host: the coordinator refuses a registration of this node at any other host."""

    @field_validator("services")
    @classmethod
    def _services(cls, value: str) -> str:
        names = [s.strip() for s in value.split(",") if s.strip()]
        unknown = [n for n in names if n not in SERVICES]
        if unknown or not names:
            raise ValueError(
                f"unknown service {unknown[0] if unknown else value!r}; known: {', '.join(SERVICES)}"
            )
        return ",".join(dict.fromkeys(names))

    @property
    def runtime_path(self) -> str:
        """`runtime_dir`, or its default: the agent's port in it keeps two meshes on one machine (same node id) from
        sharing sockets."""
        return self.runtime_dir or f"/tmp/tandem-{self.node_id}-{self.listen.rsplit(':', 1)[1]}"

    @property
    def state_path(self) -> str:
        """`state_dir`, or `<runtime_dir>/state`."""
        return self.state_dir or f"{self.runtime_path}/state"

    @property
    def service_names(self) -> list[str]:
        """The services to run, in start order (store before engines)."""
        names = self.services.split(",")
        return [s for s in ("kv_store", "engine") if s in names]

    @model_validator(mode="after")
    def _unique(self) -> NodeAgentConfig:
        ids = [e.instance_id for e in self.engines]
        dupes = sorted({i for i in ids if ids.count(i) > 1})
        if dupes:
            raise ValueError(f"engines: duplicate instance_id {dupes[0]!r}")
        ports = [(e.host, e.port + i) for e in self.engines for i in range(_api_servers(e))]
        clash = sorted({p for p in ports if ports.count(p) > 1})
        if clash:
            raise ValueError(f"engines: two engines on {clash[0][0]}:{clash[0][1]}")
        names = self.service_names
        if "kv_store" in names and self.kv_store is None:
            raise ValueError("services names kv_store but there is no kv_store section")
        if self.kv_store is not None and "kv_store" in names:
            if self.kv_store.mode == "separated" and "engine" in names:
                raise ValueError("kv_store.mode separated runs the store only: remove engine from services")
            if self.kv_store.mode == "combined" and "engine" not in names:
                raise ValueError("kv_store.mode combined runs engines too: add engine to services")
        return self


def _api_servers(engine: EngineConfig) -> int:
    """HTTP ports an engine takes on this node (one per local DP rank in external LB mode)."""
    return engine.local_dp_size if engine.data_parallel_mode == "external" else 1

"""The `node_agents:` entries of the mesh file: one per node, with the engines it launches."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from tandem.netaddr import is_wildcard, split_host_port


class RestartPolicy(BaseModel):
    """How a crashed engine is restarted: exponential backoff, then give up after a crash loop."""

    model_config = ConfigDict(extra="forbid")

    initial_backoff_s: float = Field(default=1.0, gt=0)
    """Delay before the first restart."""
    max_backoff_s: float = Field(default=30.0, gt=0)
    """The delay doubles per consecutive crash up to this."""
    max_consecutive_failures: int = Field(default=5, ge=1)
    """Crashes in a row (each before `stable_after_s`) after which the engine is left FAILED."""
    stable_after_s: float = Field(default=60.0, gt=0)
    """A run at least this long resets the crash count and the backoff."""


class EngineConfig(BaseModel):
    """One engine instance the agent launches and supervises."""

    model_config = ConfigDict(extra="forbid")

    instance_id: str = Field(min_length=1)
    """Unique id across the mesh."""
    backend: Literal["simengine", "vllm", "vllm-ascend"] = "simengine"
    """What to launch."""
    model: str = Field(min_length=1)
    """The served model name (`--served-model-name`)."""
    model_path: str | None = None
    """Weights directory or hub id passed to vLLM (required for `vllm` and `vllm-ascend`); simengine needs none."""
    tokenizer: str | None = None
    """Tokenizer directory for simengine (`--tokenizer`); the built-in tokenizer when unset."""
    host: str = "127.0.0.1"
    """Address the engine listens on and is reached at (never a wildcard)."""
    port: int = Field(gt=0, lt=65536)
    """The engine's HTTP port."""
    role: Literal["hybrid", "prefill", "decode"] = "hybrid"
    """The engine's part in serving."""
    block_size: int = Field(default=16, gt=0)
    """KV block size (`--block-size`)."""
    kv_events: bool = True
    """Publish KV events and relay them to the conductor."""
    args: list[str] = []
    """Extra arguments appended to the launch command."""
    env: dict[str, str] = {}
    """Extra environment variables of the engine process."""
    health_timeout_s: float = Field(default=300.0, gt=0)
    """How long a starting engine may take to answer `/health`."""

    @model_validator(mode="after")
    def _weights(self) -> EngineConfig:
        if self.backend != "simengine" and not self.model_path:
            raise ValueError(f"engine {self.instance_id!r}: model_path is required for backend {self.backend!r}")
        return self

    @field_validator("host")
    @classmethod
    def _host(cls, value: str) -> str:
        if is_wildcard(value):
            raise ValueError("a wildcard address cannot be reached; give the engine's own address")
        return value


class NodeAgentConfig(BaseModel):
    """A node agent: its own gRPC address, where the control plane is, and its engines."""

    model_config = ConfigDict(extra="forbid")

    node_id: str = Field(min_length=1)
    """This node's id (appears in every instance it registers)."""
    listen: str = "127.0.0.1:9300"
    """The agent's gRPC address (NodeAgent service)."""
    metrics_listen: str = "127.0.0.1:9301"
    """Prometheus `/metrics` address."""
    coordinator_address: str | None = None
    """Coordinator gRPC address; the mesh file's `coordinator.listen` when unset."""
    conductor_address: str | None = None
    """Conductor gRPC address; the mesh file's `conductor.listen` when unset."""
    runtime_dir: str | None = None
    """Where engine logs and IPC sockets go; `/tmp/tandem-<node_id>` when unset."""
    probe_interval_s: float = Field(default=2.0, gt=0)
    """How often each engine's `/health` and `/metrics` are read."""
    stop_grace_s: float = Field(default=10.0, gt=0)
    """Seconds between SIGTERM and SIGKILL when stopping an engine."""
    restart: RestartPolicy = RestartPolicy()
    """Restart policy of crashed engines."""
    engines: list[EngineConfig] = []
    """The engines of this node."""

    @field_validator("listen", "metrics_listen")
    @classmethod
    def _address(cls, value: str) -> str:
        split_host_port(value)
        return value

    @model_validator(mode="after")
    def _unique(self) -> NodeAgentConfig:
        ids = [e.instance_id for e in self.engines]
        dupes = sorted({i for i in ids if ids.count(i) > 1})
        if dupes:
            raise ValueError(f"engines: duplicate instance_id {dupes[0]!r}")
        ports = [(e.host, e.port) for e in self.engines]
        clash = sorted({p for p in ports if ports.count(p) > 1})
        if clash:
            raise ValueError(f"engines: two engines on {clash[0][0]}:{clash[0][1]}")
        return self

"""Configuration of the conductor: the `conductor:` section of the mesh YAML."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from tandem.netaddr import Address, check_replica_addresses, replica_endpoint, replica_listen

#: What goes first when the index reaches `max_entries`.
#: - `oldest_first`: the holder (engine rank) with the most entries loses its oldest-stored blocks, down to 95%
#:   of the bound; engines evict least-recently-used blocks, so the oldest stored are the likeliest gone already.
#: - `reject_new`: entries already indexed stay, new ones are refused (and counted) until removals make room.
EvictionPolicy = Literal["oldest_first", "reject_new"]


class DirectEndpoint(BaseModel):
    """An engine rank whose KV events the conductor reads itself (no node agent manages it)."""

    model_config = ConfigDict(extra="forbid")

    instance_id: str = Field(min_length=1)
    """Instance id, as registered with the coordinator."""
    model: str = Field(min_length=1)
    """Model the instance serves (`--served-model-name`)."""
    block_size: int = Field(gt=0)
    """KV block size in tokens (`--block-size`)."""
    endpoint: str = Field(min_length=1)
    """The engine's KV event PUB socket to connect to, `tcp://127.0.0.1:5557` or `ipc:///path` (already +dp_rank)."""
    replay_endpoint: str | None = None
    """The engine's replay ROUTER socket; without it a sequence gap clears the rank's entries."""
    dp_rank: int = Field(default=0, ge=0)
    """The data-parallel rank this endpoint publishes."""
    topic: str = ""
    """ZMQ topic to subscribe to (vLLM's `topic`, empty by default)."""


class ConductorConfig(BaseModel):
    """The conductor process."""

    model_config = ConfigDict(extra="forbid")

    listen: Address = "127.0.0.1:9200"
    """gRPC address (`Conductor`, health, reflection): node agents feed it, the coordinator matches against it
    (mutual TLS, docs/security.md)."""
    metrics_listen: Address = "127.0.0.1:9201"
    """Prometheus `/metrics` address."""
    replicas: int = Field(default=1, ge=1)
    """Conductor processes. Every node agent feeds every replica (each indexes every engine) and the coordinator
    matches against any healthy one through Envoy. On one host replica i listens on `listen` and `metrics_listen`
    with the port + 10 * i (see `replica_addresses`)."""
    replica_addresses: list[Address] = []
    """Replicas on different hosts (e.g. Kubernetes StatefulSet pods): where replica i is reached, one `host:port`
    per replica. Each replica then binds `listen` itself (a wildcard is allowed) and no port is shifted."""
    max_entries: int = Field(default=20_000_000, gt=0)
    """Memory bound: the most (block, holder) entries kept, about 200 bytes each (20M ~ 4 GB at worst)."""
    eviction: EvictionPolicy = "oldest_first"
    """What goes first at the bound: `oldest_first` (largest holder's oldest blocks) or `reject_new`."""
    max_blocks_per_holder: int = Field(default=250_000, gt=0)
    """Blocks one engine rank may have indexed: past it the rank's oldest blocks go first (counted in
    `tandem_conductor_holder_cap_evicted_entries_total`), so one node's agent cannot fill the whole index with
    invented blocks. Above a large engine's capacity (an 80 GB GPU holds about 30,000 16-token blocks of an 8B model;
    CPU offload adds more): raise it for engines whose GPU plus CPU blocks exceed it (about 60 MB of index each)."""
    max_ranks_per_node: int = Field(default=256, gt=0)
    """Engine ranks (instance, DP rank) one node's agent may send KV events for; events for more are dropped and
    counted in `tandem_conductor_foreign_messages_total`. With `max_blocks_per_holder`, this bounds what one node
    can put in the index."""
    match_deadline_ms: float = Field(default=50.0, gt=0)
    """A `Match` walk past this budget stops where it is: hits are reported up to the blocks walked (an
    underestimate, never a false hit) and the truncation is counted."""
    replay_timeout_s: float = Field(default=10.0, gt=0)
    """A replay not finished within this time counts as unrecoverable: the rank's entries are cleared."""
    max_pending_batches: int = Field(default=10_000, gt=0)
    """Live batches held per rank while its replay runs; more and the replay is given up (rank cleared)."""
    replay_queue_size: int = Field(default=1024, gt=0)
    """Replay requests queued per agent stream; overflow is dropped and counted (the gap clears on timeout)."""
    direct_endpoints: list[DirectEndpoint] = Field(default_factory=list)
    """Engine ranks the conductor subscribes to directly (SUB + DEALER replay), for engines without an agent."""
    direct_queue_size: int = Field(default=10_000, gt=0)
    """Batches buffered per direct endpoint between the socket and the index; overflow is dropped and counted."""

    @model_validator(mode="after")
    def _unique_direct(self) -> ConductorConfig:
        seen: set[tuple[str, int]] = set()
        for ep in self.direct_endpoints:
            key = (ep.instance_id, ep.dp_rank)
            if key in seen:
                raise ValueError(f"direct_endpoints: {ep.instance_id} rank {ep.dp_rank} is listed twice")
            seen.add(key)
        return self

    @model_validator(mode="after")
    def _reachable(self) -> ConductorConfig:
        check_replica_addresses(self.listen, self.replicas, self.replica_addresses)
        return self

    def replica_config(self, index: int) -> ConductorConfig:
        """The section as replica `index` runs it (for replicas on one host, ports +10 per replica)."""
        if not 0 <= index < self.replicas:
            raise ValueError(f"replica {index} out of range: replicas is {self.replicas}")
        if self.replica_addresses:
            return self
        return self.model_copy(
            update={
                "listen": replica_listen(self.listen, index),
                "metrics_listen": replica_listen(self.metrics_listen, index),
            }
        )

    @property
    def replica_endpoints(self) -> list[str]:
        """Where every replica's gRPC server is reached."""
        return [replica_endpoint(self.listen, i, self.replica_addresses) for i in range(self.replicas)]

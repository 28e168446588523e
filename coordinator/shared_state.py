"""State the coordinator replicas share: the instance registry (liveness as leases) and drain flags.

One coordinator keeps it in its own `InstanceTable` (`LocalState`: nothing to share, `make run` needs nothing new).
Several replicas keep it in etcd (`coordinator.etcd_state.EtcdState`): the replica an agent reports to writes each
registration, heartbeat and drain to etcd, every replica watches the prefix and applies what it sees to its own
table with `apply_change()`. Load is shared through what engines report (the heartbeats' load, written with each
report) plus each replica's own recent decisions (its ledger); there is no replica-to-replica protocol.

Writes never block a gRPC handler: the local table changes at once and etcd follows (a replica that cannot reach
etcd keeps serving from its last known state and writes again when etcd is back).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Protocol

from coordinator.instances import Health, InstanceInfo, InstanceTable
from tandem.engine_load import EngineLoad


@dataclass(frozen=True, slots=True)
class InstancePut:
    """An instance registered or reported on (health and load as of its last heartbeat)."""

    info: InstanceInfo
    health: Health
    load: EngineLoad
    #: The replica that registered it saw it answer its health probe (unverified instances are not routable).
    verified: bool = True


@dataclass(frozen=True, slots=True)
class InstanceGone:
    """An instance deregistered, or its lease ended (no replica heard from its agent for `instance_ttl_s`)."""

    instance_id: str


@dataclass(frozen=True, slots=True)
class DrainSet:
    """An operator drained (or undrained) an instance."""

    instance_id: str
    drained: bool


Change = InstancePut | InstanceGone | DrainSet


def apply_change(table: InstanceTable, change: Change, drained: set[str]) -> None:
    """Applies a change seen in the shared store to this replica's table. `drained` holds the drain flags, also of
    instances not (yet) registered here. Idempotent: a replica sees its own writes again."""
    if isinstance(change, InstancePut):
        state = table.get(change.info.instance_id)
        if state is None or state.info != change.info:
            state = table.register(change.info)
        state.verified = change.verified
        state.drained = change.info.instance_id in drained
        table.heartbeat(change.info.instance_id, change.health, change.load)
    elif isinstance(change, InstanceGone):
        table.deregister(change.instance_id)
    else:
        (drained.add if change.drained else drained.discard)(change.instance_id)
        state = table.get(change.instance_id)
        if state is not None:
            state.drained = change.drained


# --- wire form in the store (JSON: readable with `etcdctl get --prefix /tandem/`) --------------------------------


def encode_instance(put: InstancePut) -> bytes:
    return json.dumps(
        {
            "info": dataclasses.asdict(put.info),
            "health": put.health.name,
            "load": dataclasses.asdict(put.load),
            "verified": put.verified,
        },
        separators=(",", ":"),
        default=_sorted_list,
    ).encode()


def _sorted_list(value: object) -> list:
    """JSON for the load's adapter sets (`EngineLoad.adapters`): a sorted list."""
    if isinstance(value, frozenset | set):
        return sorted(value)
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def decode_instance(value: bytes) -> InstancePut:
    """ValueError when the value is not an instance record."""
    try:
        data = json.loads(value)
        info = InstanceInfo(**data["info"])
        known = {f.name for f in dataclasses.fields(EngineLoad)}
        load = EngineLoad(**{k: v for k, v in data.get("load", {}).items() if k in known})
        load.adapters, load.active_adapters = frozenset(load.adapters), frozenset(load.active_adapters)
        # JSON keys are strings: the per-rank maps get their int ranks back.
        load.progress = {int(rank): (int(p), int(g)) for rank, (p, g) in load.progress.items()}
        load.prefix_hits = {int(rank): int(hits) for rank, hits in load.prefix_hits.items()}
        return InstancePut(info, Health[data["health"]], load, bool(data.get("verified", True)))
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"not an instance record: {exc}") from None


class SharedState(Protocol):
    """Where registrations, heartbeats and drains go besides this replica's own table."""

    async def start(self, table: InstanceTable) -> None:
        """Loads what the store knows into `table` and follows its changes."""

    def registered(self, info: InstanceInfo, verified: bool = True) -> None: ...

    def verified(self, instance_id: str) -> None:
        """The instance answered its health probe."""

    def reported(self, instance_id: str, health: Health, load: EngineLoad) -> None: ...

    def deregistered(self, instance_id: str) -> None: ...

    def drain_set(self, instance_id: str, drained: bool) -> None: ...

    async def close(self) -> None: ...


class LocalState:
    """One coordinator: its table is the whole truth."""

    async def start(self, table: InstanceTable) -> None:
        pass

    def registered(self, info: InstanceInfo, verified: bool = True) -> None:
        pass

    def verified(self, instance_id: str) -> None:
        pass

    def reported(self, instance_id: str, health: Health, load: EngineLoad) -> None:
        pass

    def deregistered(self, instance_id: str) -> None:
        pass

    def drain_set(self, instance_id: str, drained: bool) -> None:
        pass

    async def close(self) -> None:
        pass

"""The coordinator's view of engine instances: what registered, how healthy and loaded each is (pure core)."""

from __future__ import annotations

import enum
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from tandem.engine_load import EngineLoad


class Health(enum.Enum):
    """Health as reported by node agents (mirrors `tandem.v1.Health`)."""

    STARTING = 1
    HEALTHY = 2
    UNHEALTHY = 3


@dataclass(frozen=True, slots=True)
class InstanceInfo:
    """An instance as registered (mirrors `tandem.v1.Instance`)."""

    instance_id: str
    model: str
    address: str  # host:port, IPv6 bracketed
    role: str  # "hybrid" | "prefill" | "decode"
    dispatch: str  # "aggregated" | "handoff" | "trigger"
    node_id: str = ""
    backend: str = ""
    block_size: int = 16
    data_parallel_size: int = 1
    kv_connector: str = ""


@dataclass(slots=True)
class InstanceState:
    """Everything the coordinator tracks about one instance."""

    info: InstanceInfo
    health: Health = Health.HEALTHY
    load: EngineLoad = field(default_factory=EngineLoad)
    drained: bool = False
    #: False until the instance answered the coordinator's health probe (`coordinator.probe_instances`): a new
    #: registration is not routable on the agent's word alone.
    verified: bool = True
    registered_at: float = field(default_factory=time.time)
    last_heartbeat_at: float = field(default_factory=time.time)
    vouched_at: float = (
        0.0  # when the engine last answered the coordinator's own probe while its agent was silent
    )

    @property
    def heard_at(self) -> float:
        """The last sign of life: a heartbeat from its agent, or an answer of the engine itself."""
        return max(self.last_heartbeat_at, self.vouched_at)

    @property
    def routable(self) -> bool:
        """Healthy, answered its probe and not drained: may receive new requests."""
        return self.health is Health.HEALTHY and self.verified and not self.drained


class InstanceTable:
    """Registered instances by id, with the models ever served (so a model whose engines all stopped answers
    503, not 404)."""

    def __init__(self, configured_models: Iterable[str] = ()) -> None:
        self._by_id: dict[str, InstanceState] = {}
        self._by_model: dict[str, list[InstanceState]] = {}
        self.known_models: set[str] = set(configured_models)

    def register(self, info: InstanceInfo, verified: bool = True) -> InstanceState:
        """Adds `info`, replacing an instance with the same id (keeping its drain flag); `verified=False` keeps it
        unroutable until it is marked verified."""
        old = self._by_id.pop(info.instance_id, None)
        if old is not None:
            self._unindex(old)
        state = InstanceState(info=info, drained=old.drained if old else False, verified=verified)
        self._by_id[info.instance_id] = state
        self._by_model.setdefault(info.model, []).append(state)
        self.known_models.add(info.model)
        return state

    def deregister(self, instance_id: str) -> InstanceState | None:
        """Removes an instance; returns it, or None when unknown."""
        state = self._by_id.pop(instance_id, None)
        if state is not None:
            self._unindex(state)
        return state

    def _unindex(self, state: InstanceState) -> None:
        peers = self._by_model.get(state.info.model, [])
        if state in peers:
            peers.remove(state)

    def count_node(self, node_id: str, besides: str = "") -> int:
        """Instances registered for `node_id`, not counting the id `besides`."""
        return sum(
            1 for s in self._by_id.values() if s.info.node_id == node_id and s.info.instance_id != besides
        )

    def get(self, instance_id: str) -> InstanceState | None:
        """The instance with this id, or None."""
        return self._by_id.get(instance_id)

    def all(self) -> list[InstanceState]:
        """Every instance, sorted by id."""
        return [self._by_id[k] for k in sorted(self._by_id)]

    def serving(self, model: str) -> list[InstanceState]:
        """Instances registered for `model`, routable or not (the list is the table's own: do not modify)."""
        return self._by_model.get(model, [])

    def routable_models(self) -> list[str]:
        """Models with at least one routable instance."""
        return sorted(m for m, peers in self._by_model.items() if any(s.routable for s in peers))

    def heartbeat(self, instance_id: str, health: Health, load: EngineLoad, now: float | None = None) -> bool:
        """Records a report; False when the instance is unknown."""
        state = self._by_id.get(instance_id)
        if state is None:
            return False
        state.health = health
        state.load = load
        state.last_heartbeat_at = time.time() if now is None else now
        return True

    def to_vouch(self, max_silence_s: float, now: float | None = None) -> list[InstanceState]:
        """Healthy instances whose agent has been silent for half of `max_silence_s` (and the engine not heard from
        since): the engine itself should be asked before `expire` marks it unhealthy. A frozen or restarting agent
        does not make its engines unroutable while they answer."""
        now = time.time() if now is None else now
        return [
            s
            for s in self._by_id.values()
            if s.health is Health.HEALTHY and now - s.heard_at > max_silence_s / 2
        ]

    def vouch(self, instance_id: str, now: float | None = None) -> bool:
        """The engine answered the coordinator's health probe while its agent is silent: it keeps its health (the
        agent's last report) for another `max_silence_s`. False when the instance is unknown."""
        state = self._by_id.get(instance_id)
        if state is None:
            return False
        state.vouched_at = time.time() if now is None else now
        return True

    def expire(self, max_silence_s: float, now: float | None = None) -> list[str]:
        """Marks instances silent for longer than `max_silence_s` (no heartbeat, and no answer of the engine to the
        coordinator's own probe) unhealthy; returns their ids."""
        now = time.time() if now is None else now
        expired = []
        for state in self._by_id.values():
            if state.health is not Health.UNHEALTHY and now - state.heard_at > max_silence_s:
                state.health = Health.UNHEALTHY
                expired.append(state.info.instance_id)
        return expired

    def silent(self, max_silence_s: float, now: float | None = None) -> list[str]:
        """Ids of instances without a heartbeat (or registration) for longer than `max_silence_s`."""
        now = time.time() if now is None else now
        return [iid for iid, s in self._by_id.items() if now - s.last_heartbeat_at > max_silence_s]

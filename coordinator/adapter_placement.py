"""LoRA adapter placement, the pure part: which instances a request for an adapter may go to, whether the chosen one
must load the adapter first, which adapter an engine past its slots unloads, and which instances are held back
after a failed load. The shell that calls the node agents (`NodeAgent.LoadAdapter`, `UnloadAdapter`) is
`coordinator.adapter_loader`; the picker (`coordinator.picker`) filters its candidates here before any policy
scores them.

A request naming adapter `a` of base model `m` (`OpenAIRequest.adapter`) may go to an instance of `m` that:
- is not held back for `a` (a load of `a` failed there within `failed_hold_s`), and
- holds `a` (its heartbeat lists it in `EngineLoad.adapters`, or this coordinator loaded it there within
  `loaded_memory_s`: the heartbeat has not said so yet), or has a free slot (fewer adapters than `max_loras`, or
  no `max_loras` reported).
When no instance passes the second test, every instance not held back is a candidate: the one chosen loads `a`
beside the others (vLLM keeps every loaded adapter servable; its `--max-cpu-loras` cache evicts the least recently
used weights, which cost a reload at their next step). The policy then picks among the candidates
(`lora_affinity` weighs residency, free slots and the cold-load cost; any other policy picks on its own terms),
and the chosen instance loads `a` first when it does not hold it (`needs_load`). An engine that then holds more
adapters than its `max_loras` unloads one (`unload_victim`): the least recently used with no request in flight.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from coordinator.instances import InstanceState


def has_free_slot(state: InstanceState, resident: frozenset[str] | None = None) -> bool:
    """The instance can take one more adapter without evicting one: fewer adapters than its `max_loras`, or no
    slot count reported. `resident`: the adapters it holds (its heartbeat's when None)."""
    load = state.load
    held = load.adapters if resident is None else resident
    return not load.max_loras or len(held) < load.max_loras


def adapter_candidates(
    states: Sequence[InstanceState],
    adapter: str,
    held_back: frozenset[str] = frozenset(),
    resident: Mapping[str, frozenset[str]] | None = None,
) -> list[InstanceState]:
    """The instances of `states` a request for `adapter` may go to (see the module doc). `held_back`: instance ids
    not to be chosen for it now; `resident`: per instance id, the adapters it holds as this coordinator knows it
    (`AdapterHolds.resident`; the heartbeat's list for an instance left out)."""
    resident = resident or {}
    open_ = [s for s in states if s.info.instance_id not in held_back]
    fitting = []
    for s in open_:
        held = resident.get(s.info.instance_id, s.load.adapters)
        if adapter in held or has_free_slot(s, held):
            fitting.append(s)
    return fitting or open_


def needs_load(state: InstanceState, adapter: str, resident: frozenset[str] | None = None) -> bool:
    """The instance must load `adapter` before it is sent the request: it does not hold it (`resident`: as this
    coordinator knows it, `AdapterHolds.resident`; the heartbeat's list when None)."""
    held = state.load.adapters if resident is None else resident
    return bool(adapter) and adapter not in held


def unload_victim(
    state: InstanceState,
    loaded: str,
    resident: frozenset[str],
    inflight: Mapping[str, int],
    last_used: Mapping[str, float],
) -> str | None:
    """After `loaded` was loaded on `state`: the adapter to unload so that the engine holds no more than its
    `max_loras`: the least recently used (`last_used`, this coordinator's routing) of those with no request in
    flight (`inflight` through this coordinator, and none running or waiting on the engine: `active_adapters`),
    never `loaded`. None when it fits, the engine reports no slot count, or every other adapter is busy (it stays:
    the next load tries again)."""
    load = state.load
    held = resident | {loaded}
    if not load.max_loras or len(held) <= load.max_loras:
        return None
    idle = [a for a in held if a != loaded and not inflight.get(a) and a not in load.active_adapters]
    if not idle:
        return None
    return min(sorted(idle), key=lambda a: last_used.get(a, -math.inf))


@dataclass(frozen=True, slots=True)
class LoadFailure:
    """A failed load of an adapter on an instance, as the client is told."""

    message: str
    retryable: (
        bool  # the engine or agent was unavailable or late (503); False: the adapter itself failed (500)
    )
    at: float


class AdapterHolds:
    """What this coordinator knows of adapters beyond the heartbeats: its own loads (resident until the heartbeat
    says so, for `loaded_memory_s`), its own unloads (gone, likewise), the loads that failed (the instance held back
    for the adapter for `failed_hold_s`), and the adapter requests it routed (in flight, and when last, per instance
    and adapter: what `unload_victim` drains and orders by). Times are the caller's clock (monotonic seconds)."""

    def __init__(self, failed_hold_s: float, loaded_memory_s: float) -> None:
        self.failed_hold_s = failed_hold_s
        self.loaded_memory_s = loaded_memory_s
        self._failed: dict[tuple[str, str], LoadFailure] = {}
        self._loaded: dict[tuple[str, str], float] = {}
        self._unloaded: dict[tuple[str, str], float] = {}
        self._inflight: dict[tuple[str, str], int] = {}
        self._last_used: dict[tuple[str, str], float] = {}

    def failed(self, instance_id: str, adapter: str, failure: LoadFailure) -> None:
        self._failed[(instance_id, adapter)] = failure
        self._loaded.pop((instance_id, adapter), None)

    def loaded(self, instance_id: str, adapter: str, now: float) -> None:
        self._loaded[(instance_id, adapter)] = now
        self._unloaded.pop((instance_id, adapter), None)
        self._failed.pop((instance_id, adapter), None)

    def unloaded(self, instance_id: str, adapter: str, now: float) -> None:
        """`adapter` leaves `instance_id` (marked as soon as the unload is decided: no request follows it there)."""
        self._unloaded[(instance_id, adapter)] = now
        self._loaded.pop((instance_id, adapter), None)

    def unload_failed(self, instance_id: str, adapter: str) -> None:
        """The unload did not happen: `adapter` is resident on `instance_id` again (as its heartbeat says)."""
        self._unloaded.pop((instance_id, adapter), None)

    def routed(self, instance_id: str, adapter: str, now: float) -> None:
        """A request for `adapter` was routed to `instance_id` (until `ended`)."""
        key = (instance_id, adapter)
        self._inflight[key] = self._inflight.get(key, 0) + 1
        self._last_used[key] = now

    def ended(self, instance_id: str, adapter: str) -> None:
        key = (instance_id, adapter)
        left = self._inflight.get(key, 0) - 1
        if left > 0:
            self._inflight[key] = left
        else:
            self._inflight.pop(key, None)

    def inflight(self, instance_id: str) -> dict[str, int]:
        """Per adapter, requests in flight on `instance_id` through this coordinator."""
        return {a: n for (iid, a), n in self._inflight.items() if iid == instance_id}

    def last_used(self, instance_id: str) -> dict[str, float]:
        """Per adapter, when this coordinator last routed a request for it to `instance_id`."""
        return {a: at for (iid, a), at in self._last_used.items() if iid == instance_id}

    def held_back(self, adapter: str, now: float) -> frozenset[str]:
        """Instance ids a load of `adapter` failed on within `failed_hold_s`."""
        self._forget(now)
        return frozenset(iid for (iid, a) in self._failed if a == adapter)

    def last_failure(self, adapter: str, now: float) -> LoadFailure | None:
        """The latest failure of `adapter` still holding an instance back."""
        self._forget(now)
        failures = [f for (_, a), f in self._failed.items() if a == adapter]
        return max(failures, key=lambda f: f.at) if failures else None

    def resident(self, state: InstanceState, now: float) -> frozenset[str]:
        """The adapters `state` holds as this coordinator knows it: its heartbeat's, with the loads it made and
        without the unloads it made within `loaded_memory_s` (the heartbeat has not caught up yet)."""
        iid, memory = state.info.instance_id, self.loaded_memory_s
        added = {a for (i, a), at in self._loaded.items() if i == iid and now - at <= memory}
        gone = {a for (i, a), at in self._unloaded.items() if i == iid and now - at <= memory}
        return frozenset((state.load.adapters - gone) | added)

    def resident_all(self, states: Sequence[InstanceState], now: float) -> dict[str, frozenset[str]]:
        """`resident` of each of `states`, by instance id."""
        return {s.info.instance_id: self.resident(s, now) for s in states}

    def _forget(self, now: float) -> None:
        hold, memory = self.failed_hold_s, self.loaded_memory_s
        if any(now - f.at > hold for f in self._failed.values()):
            self._failed = {k: f for k, f in self._failed.items() if now - f.at <= hold}
        if len(self._loaded) + len(self._unloaded) > 4096:
            self._loaded = {k: at for k, at in self._loaded.items() if now - at <= memory}
            self._unloaded = {k: at for k, at in self._unloaded.items() if now - at <= memory}
        if len(self._last_used) > 4096:  # the oldest half: instances and adapters long gone
            keep = sorted(self._last_used.items(), key=lambda kv: kv[1])[len(self._last_used) // 2 :]
            self._last_used = dict(keep)

"""LoRA adapter placement, the pure part: which instances a request for an adapter may go to, whether the chosen one
must load the adapter first, and which instances are held back after a failed load. The shell that calls the
node agents (`NodeAgent.LoadAdapter`) is `coordinator.adapter_loader`; the picker (`coordinator.picker`) filters
its candidates here before any policy scores them.

A request naming adapter `a` of base model `m` (`OpenAIRequest.adapter`) may go to an instance of `m` that:
- is not held back for `a` (a load of `a` failed there within `failed_hold_s`), and
- holds `a` (its heartbeat lists it in `EngineLoad.adapters`, or this coordinator loaded it there within
  `loaded_memory_s`: the heartbeat has not said so yet), or has a free slot (fewer adapters than `max_loras`, or
  no `max_loras` reported).
When no instance passes the second test, every instance not held back is a candidate: the one chosen loads `a`
beside the others (vLLM keeps every loaded adapter servable; its `--max-cpu-loras` cache evicts the least recently
used weights, which cost a reload at their next step). The policy then picks among the candidates
(`lora_affinity` weighs residency, free slots and the cold-load cost; any other policy picks on its own terms),
and the chosen instance loads `a` first when it does not hold it (`needs_load`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from coordinator.instances import InstanceState


def has_free_slot(state: InstanceState, recent: frozenset[str] = frozenset()) -> bool:
    """The instance can take one more adapter without evicting one: fewer adapters than its `max_loras`, or no
    slot count reported."""
    load = state.load
    held = load.adapters | recent
    return not load.max_loras or len(held) < load.max_loras


def adapter_candidates(
    states: Sequence[InstanceState],
    adapter: str,
    held_back: frozenset[str] = frozenset(),
    recent: dict[str, frozenset[str]] | None = None,
) -> list[InstanceState]:
    """The instances of `states` a request for `adapter` may go to (see the module doc). `held_back`: instance ids
    not to be chosen for it now; `recent`: per instance id, adapters loaded there lately that its heartbeat does
    not list yet."""
    recent = recent or {}
    open_ = [s for s in states if s.info.instance_id not in held_back]
    fitting = [
        s
        for s in open_
        if adapter in s.load.adapters
        or adapter in recent.get(s.info.instance_id, frozenset())
        or has_free_slot(s, recent.get(s.info.instance_id, frozenset()))
    ]
    return fitting or open_


def needs_load(state: InstanceState, adapter: str, recent: frozenset[str] = frozenset()) -> bool:
    """The instance must load `adapter` before it is sent the request: its heartbeat does not list it and this
    coordinator did not load it there lately (`recent`)."""
    return bool(adapter) and adapter not in state.load.adapters and adapter not in recent


@dataclass(frozen=True, slots=True)
class LoadFailure:
    """A failed load of an adapter on an instance, as the client is told."""

    message: str
    retryable: (
        bool  # the engine or agent was unavailable or late (503); False: the adapter itself failed (500)
    )
    at: float


class AdapterHolds:
    """What this coordinator knows of its own loads: the ones that succeeded (resident until the heartbeat says so,
    for `loaded_memory_s`) and the ones that failed (the instance held back for the adapter for `failed_hold_s`).
    Times are the caller's clock (monotonic seconds)."""

    def __init__(self, failed_hold_s: float, loaded_memory_s: float) -> None:
        self.failed_hold_s = failed_hold_s
        self.loaded_memory_s = loaded_memory_s
        self._failed: dict[tuple[str, str], LoadFailure] = {}
        self._loaded: dict[tuple[str, str], float] = {}

    def failed(self, instance_id: str, adapter: str, failure: LoadFailure) -> None:
        self._failed[(instance_id, adapter)] = failure
        self._loaded.pop((instance_id, adapter), None)

    def loaded(self, instance_id: str, adapter: str, now: float) -> None:
        self._loaded[(instance_id, adapter)] = now
        self._failed.pop((instance_id, adapter), None)

    def held_back(self, adapter: str, now: float) -> frozenset[str]:
        """Instance ids a load of `adapter` failed on within `failed_hold_s`."""
        self._forget(now)
        return frozenset(iid for (iid, a) in self._failed if a == adapter)

    def last_failure(self, adapter: str, now: float) -> LoadFailure | None:
        """The latest failure of `adapter` still holding an instance back."""
        self._forget(now)
        failures = [f for (_, a), f in self._failed.items() if a == adapter]
        return max(failures, key=lambda f: f.at) if failures else None

    def recent(self, instance_id: str, now: float) -> frozenset[str]:
        """Adapters this coordinator loaded on `instance_id` within `loaded_memory_s`."""
        memory = self.loaded_memory_s
        return frozenset(
            a for (iid, a), at in self._loaded.items() if iid == instance_id and now - at <= memory
        )

    def recent_all(self, now: float) -> dict[str, frozenset[str]]:
        """`recent` for every instance with one."""
        out: dict[str, set[str]] = {}
        for (iid, a), at in self._loaded.items():
            if now - at <= self.loaded_memory_s:
                out.setdefault(iid, set()).add(a)
        return {iid: frozenset(names) for iid, names in out.items()}

    def _forget(self, now: float) -> None:
        hold = self.failed_hold_s
        if any(now - f.at > hold for f in self._failed.values()):
            self._failed = {k: f for k, f in self._failed.items() if now - f.at <= hold}
        if len(self._loaded) > 4096:
            memory = self.loaded_memory_s
            self._loaded = {k: at for k, at in self._loaded.items() if now - at <= memory}

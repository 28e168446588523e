"""Explicit registration of the built-in scheduling policies, and building the one a config names."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from coordinator.scheduling import dynamo, kv_affinity, least_load, llm_d, round_robin, sglang_cache_aware
from coordinator.scheduling.interface import Policy

Factory = Callable[[Mapping[str, Any] | None], Policy]
_FACTORIES: dict[str, Factory] = {}


def register(type_name: str, factory: Factory) -> None:
    """Adds a policy type; a duplicate type is an error."""
    if type_name in _FACTORIES:
        raise ValueError(f"scheduling policy type {type_name!r} is registered twice")
    _FACTORIES[type_name] = factory


def register_builtin_policies() -> None:
    """Registers every built-in policy type (idempotent). The one list of what Tandem ships."""
    if _FACTORIES:
        return
    register(round_robin.TYPE, round_robin.create)
    register(least_load.TYPE, least_load.create)
    register(kv_affinity.TYPE, kv_affinity.create)
    register(dynamo.TYPE, dynamo.create)
    register(sglang_cache_aware.TYPE, sglang_cache_aware.create)
    register(llm_d.TYPE, llm_d.create)


def policy_types() -> list[str]:
    """Every registered type, sorted."""
    register_builtin_policies()
    return sorted(_FACTORIES)


def create_policy(type_name: str, params: Mapping[str, Any] | None = None) -> Policy:
    """A new policy of `type_name`; ValueError naming the known types, or the bad parameter."""
    register_builtin_policies()
    factory = _FACTORIES.get(type_name)
    if factory is None:
        raise ValueError(f"unknown scheduling policy {type_name!r} (known: {', '.join(sorted(_FACTORIES))})")
    return factory(params)

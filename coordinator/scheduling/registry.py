"""Explicit registration of the built-in scheduling policies."""

from __future__ import annotations

from collections.abc import Callable

from coordinator.scheduling import least_load, round_robin
from coordinator.scheduling.interface import Policy

_FACTORIES: dict[str, Callable[[], Policy]] = {}


def register(name: str, factory: Callable[[], Policy]) -> None:
    """Adds a policy type; a duplicate name is an error."""
    if name in _FACTORIES:
        raise ValueError(f"scheduling policy {name!r} is registered twice")
    _FACTORIES[name] = factory


def register_builtin_policies() -> None:
    """Registers every built-in policy (idempotent)."""
    if _FACTORIES:
        return
    register(round_robin.TYPE, round_robin.create)
    register(least_load.TYPE, least_load.create)


def create_policy(name: str) -> Policy:
    """A new policy of type `name`; ValueError naming the known types when unknown."""
    register_builtin_policies()
    try:
        return _FACTORIES[name]()
    except KeyError:
        raise ValueError(f"unknown scheduling policy {name!r} (known: {', '.join(sorted(_FACTORIES))})") from None

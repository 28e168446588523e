"""Explicit registration of the built-in scheduling policies, and building the one a config names.

Each policy module declares itself once (`POLICY`, a `PolicyType`: type name, parameter dataclass, factory and
config section); this registry lists those declarations, and the coordinator's config asks it which `scheduler`
sections exist and what their parameters are, so a new policy is one module plus one line here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from coordinator.scheduling import (
    dynamo,
    kv_affinity,
    least_load,
    llm_d,
    lora_affinity,
    round_robin,
    sglang_cache_aware,
)
from coordinator.scheduling.interface import Policy, PolicyType
from coordinator.scheduling.params import as_dict, parse_params

_TYPES: dict[str, PolicyType] = {}


def register(policy: PolicyType) -> None:
    """Adds a policy type; a duplicate type or section is an error."""
    if policy.name in _TYPES:
        raise ValueError(f"scheduling policy type {policy.name!r} is registered twice")
    if policy.section is not None and any(p.section == policy.section for p in _TYPES.values()):
        raise ValueError(f"scheduler section {policy.section!r} is registered twice")
    _TYPES[policy.name] = policy


def register_builtin_policies() -> None:
    """Registers every built-in policy type (idempotent). The one list of what Tandem ships."""
    if _TYPES:
        return
    register(round_robin.POLICY)
    register(least_load.POLICY)
    register(kv_affinity.POLICY)
    register(dynamo.POLICY)
    register(sglang_cache_aware.POLICY)
    register(llm_d.POLICY)
    register(lora_affinity.POLICY)


def policy_types() -> list[str]:
    """Every registered type, sorted."""
    register_builtin_policies()
    return sorted(_TYPES)


def param_sections() -> dict[str, PolicyType]:
    """The `scheduler` sections that hold parameters, each with its policy type, in registration order."""
    register_builtin_policies()
    return {p.section: p for p in _TYPES.values() if p.section is not None}


def _registered(type_name: str) -> PolicyType:
    register_builtin_policies()
    policy = _TYPES.get(type_name)
    if policy is None:
        raise ValueError(f"unknown scheduling policy {type_name!r} (known: {', '.join(sorted(_TYPES))})")
    return policy


def create_policy(type_name: str, params: Mapping[str, Any] | None = None) -> Policy:
    """A new policy of `type_name`; ValueError naming the known types, or the bad parameter."""
    return _registered(type_name).create(params)


def policy_params(type_name: str, raw: Mapping[str, Any] | None) -> dict[str, Any]:
    """`raw` parameters of `type_name` validated and completed with the defaults (for the effective config);
    ValueError naming the known types, or the bad parameter."""
    policy = _registered(type_name)
    return as_dict(parse_params(policy.params, raw, policy.name))


def section_of(type_name: str) -> str | None:
    """The `scheduler` section holding the parameters of `type_name` (None when it takes none)."""
    return _registered(type_name).section

"""Scheduling policies as plug-ins: `interface` defines them, one module per policy, `registry` lists them."""

from coordinator.scheduling.interface import NO_MATCH, Candidate, KvMatch, Policy, RequestFacts
from coordinator.scheduling.registry import create_policy, policy_types

__all__ = ["NO_MATCH", "Candidate", "KvMatch", "Policy", "RequestFacts", "create_policy", "policy_types"]

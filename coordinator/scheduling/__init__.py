"""Scheduling policies as plug-ins: `interface` defines them, one module per policy, `registry` lists them."""

from coordinator.scheduling.interface import Candidate, Policy, RequestFacts
from coordinator.scheduling.registry import create_policy

__all__ = ["Candidate", "Policy", "RequestFacts", "create_policy"]

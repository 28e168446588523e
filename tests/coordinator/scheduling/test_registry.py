import pytest

from coordinator.scheduling import create_policy, policy_types
from coordinator.scheduling.registry import register


def test_builtins_are_registered_once():
    assert policy_types() == [
        "dynamo",
        "kv_affinity",
        "least_load",
        "llm_d",
        "round_robin",
        "sglang_cache_aware",
    ]
    with pytest.raises(ValueError, match="registered twice"):
        register("least_load", lambda raw: None)


def test_unknown_policy_names_known_ones():
    with pytest.raises(ValueError, match="unknown scheduling policy 'fastest'.*kv_affinity.*least_load"):
        create_policy("fastest")

import re

import pytest

from coordinator.scheduling import create_policy, dynamo, least_load, policy_types
from coordinator.scheduling.interface import PolicyType
from coordinator.scheduling.registry import param_sections, register
from tests.helpers import ROOT


def test_builtins_are_registered_once():
    assert policy_types() == [
        "dynamo",
        "kv_affinity",
        "least_load",
        "llm_d",
        "lora_affinity",
        "round_robin",
        "sglang_cache_aware",
    ]
    with pytest.raises(ValueError, match="registered twice"):
        register(least_load.POLICY)


def test_policies_with_parameters_own_one_scheduler_section_each():
    assert list(param_sections()) == [
        "kv_affinity",
        "dynamo",
        "sglang_cache_aware",
        "llm_d",
        "lora_affinity",
    ]
    assert all(policy.name == section for section, policy in param_sections().items())
    with pytest.raises(ValueError, match="section 'dynamo' is registered twice"):
        register(PolicyType("dynamo_again", dynamo.Params, dynamo.create, section="dynamo"))
    assert "dynamo_again" not in policy_types()


def test_default_config_lists_every_policy():
    text = (ROOT / "configs" / "default.yaml").read_text()
    comment = re.search(r"^\s*# (.*)\n\s*policy:", text, re.M).group(1)
    assert set(re.findall(r"[a-z_]+", comment)) >= set(policy_types())


def test_unknown_policy_names_known_ones():
    with pytest.raises(ValueError, match="unknown scheduling policy 'fastest'.*kv_affinity.*least_load"):
        create_policy("fastest")


@pytest.mark.parametrize(
    ("policy", "params", "message"),
    [
        ("dynamo", {"router_temperature": -1}, "dynamo.router_temperature: must be >= 0"),
        ("llm_d", {"queue_weight": True}, "llm_d.queue_weight: must be a number"),
        ("sglang_cache_aware", {"balance_rel_threshold": 0.5}, "balance_rel_threshold: must be >= 1"),
        ("sglang_cache_aware", {"below_threshold": "random"}, "below_threshold: must be one of"),
        ("round_robin", {"x": 1}, "round_robin.x: unknown parameter"),
    ],
)
def test_bad_parameters_name_policy_and_key(policy, params, message):
    with pytest.raises(ValueError, match=message):
        create_policy(policy, params)

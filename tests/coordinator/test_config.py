"""The scheduler section: named policies, parameters, legacy keys, and reloads when the file changes."""

import asyncio
import logging
import os
from dataclasses import dataclass

import pytest
import yaml

from coordinator.config_watch import ConfigWatch, watch_config
from coordinator.scheduling import least_load, registry
from coordinator.scheduling.interface import PolicyType
from coordinator.tenants import Tier
from mesh.config import ConfigError, load_mesh_config, parse_mesh_config
from tests.helpers import eventually, make_picker


def scheduler(**section):
    return parse_mesh_config({"coordinator": {"scheduler": section}}, "mesh.yaml").coordinator.scheduler


def test_effective_config_fills_defaults():
    s = scheduler(policy="kv_affinity", kv_affinity={"load_weight": 0.5})
    assert (
        s.kv_affinity["load_weight"] == 0.5
        and s.kv_affinity["w_npu"] == 1.0
        and s.kv_affinity["w_disk"] == 0.0
    )
    assert s.build().params.load_weight == 0.5


def test_legacy_flat_keys_migrate_with_a_warning_and_nested_wins(caplog):
    with caplog.at_level(logging.WARNING):
        s = scheduler(
            policy="kv_affinity",
            kv_affinity_load_weight=0.25,
            kv_affinity_w_cpu=0.5,
            kv_affinity={"w_cpu": 0.75},
        )
    assert s.kv_affinity["load_weight"] == 0.25
    assert s.kv_affinity["w_cpu"] == 0.75
    messages = " ".join(r.getMessage() for r in caplog.records)
    assert (
        "kv_affinity_load_weight is deprecated" in messages
        and "kv_affinity.w_cpu is set and wins" in messages
    )


def test_named_policies():
    s = scheduler(
        policy="hot", policies=[{"name": "hot", "type": "dynamo", "params": {"router_temperature": 0.3}}]
    )
    assert s.build().name == "dynamo" and s.build().params.router_temperature == 0.3


def test_decode_policy_is_least_load_unless_named():
    assert scheduler().build_decode().name == "least_load"
    s = scheduler(decode_policy="hot", policies=[{"name": "hot", "type": "llm_d", "params": {"seed": 7}}])
    assert s.build_decode().name == "llm_d" and s.build_decode().params.seed == 7
    assert (
        scheduler(decode_policy="kv_affinity", kv_affinity={"w_cpu": 0.5}).build_decode().params.w_cpu == 0.5
    )


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"policy": "nope"}, "unknown scheduling policy 'nope'"),
        ({"decode_policy": "nope"}, "decode_policy: unknown scheduling policy 'nope'"),
        ({"kv_affinity": {"w_npu": -1}}, "kv_affinity.w_npu: must be >= 0"),
        ({"kv_affinity_bogus": 1}, "kv_affinity.bogus: unknown parameter"),
        (
            {"policies": [{"name": "a", "type": "dynamo"}, {"name": "a", "type": "llm_d"}]},
            "duplicate policy name 'a'",
        ),
        ({"policies": [{"name": "least_load", "type": "dynamo"}]}, "duplicate policy name 'least_load'"),
        ({"policies": [{"name": "a", "type": "magic"}]}, "policies.a.type: unknown policy type 'magic'"),
        ({"policies": [{"name": "a", "type": "dynamo", "params": {"x": 1}}]}, "dynamo.x: unknown parameter"),
        ({"match_timeout": 5}, "scheduler.match_timeout: unknown key"),
    ],
)
def test_bad_scheduler_config_fails_naming_the_key(section, message):
    with pytest.raises(ConfigError) as info:
        scheduler(**section)
    assert message in str(info.value) and "\n" not in str(info.value)


@dataclass(frozen=True)
class DepthParams:
    """A policy type the tests register."""

    depth: int = 3  # a parameter with a default


def test_a_policy_types_registration_is_all_the_config_needs(monkeypatch):
    registry.register_builtin_policies()
    deep = PolicyType("deep", DepthParams, least_load.create, section="deep")
    monkeypatch.setitem(registry._TYPES, "deep", deep)
    assert scheduler(policy="deep", deep={"depth": 5}).section("deep") == {"depth": 5}
    assert scheduler().section("deep") == {"depth": 3}  # defaults in the effective config
    with pytest.raises(ConfigError, match=r"coordinator.scheduler: deep.depth: must be >= 0"):
        scheduler(deep={"depth": -1})
    with pytest.raises(ConfigError, match=r"coordinator.scheduler.least_load: unknown key"):
        scheduler(least_load={})  # a type without parameters has no section


def policy_file(path, policy: str) -> None:
    path.write_text(yaml.safe_dump({"coordinator": {"scheduler": {"policy": policy}}}))


@pytest.fixture
def watched(tmp_path):
    """A mesh file running `least_load`, its picker, and the watch that reloads the file into them."""
    path = tmp_path / "mesh.yaml"
    policy_file(path, "least_load")
    running = load_mesh_config(path)
    picker = make_picker()
    return path, running, picker, ConfigWatch(running, load_mesh_config, picker, None)


def test_scheduler_reloads_when_the_content_changes_and_a_bad_file_keeps_it(watched, caplog):
    path, running, picker, watch = watched
    assert watch.poll() is False  # the file the mesh started with: nothing to apply
    policy_file(path, "kv_affinity")
    assert watch.poll() is True and watch.poll() is False  # applied once, then unchanged
    assert picker.policy.name == "kv_affinity" and running.coordinator.scheduler.policy == "kv_affinity"
    with caplog.at_level(logging.ERROR):
        path.write_text("coordinator: {scheduler: {policy: nope}}\n")
        assert watch.poll() is False
    assert "reload failed" in caplog.text and "unknown scheduling policy 'nope'" in caplog.records[-1].error
    assert picker.policy.name == "kv_affinity"  # a bad file keeps the running scheduler


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        ("", "empty"),
        ("   \n", "empty"),
        ("# being written\n", "empty"),  # an empty YAML document, not an empty mesh
        ("coordinator: {scheduler: {policy: dyn", "not YAML"),
        ("\t- [", "not YAML"),
    ],
)
def test_empty_or_unparsable_file_is_skipped_with_a_warning(watched, caplog, content, problem):
    path, running, picker, watch = watched
    policy_file(path, "kv_affinity")
    watch.poll()
    with caplog.at_level(logging.WARNING):
        path.write_text(content)
        assert watch.poll() is False
    (record,) = caplog.records
    assert record.levelno == logging.WARNING and "keeping the running scheduler" in record.getMessage()
    assert record.problem.startswith(problem)
    assert picker.policy.name == "kv_affinity" and running.coordinator.scheduler.policy == "kv_affinity"
    policy_file(path, "round_robin")  # the editor finishes writing
    assert watch.poll() is True and picker.policy.name == "round_robin"


def test_a_rewrite_within_one_mtime_tick_is_still_seen(watched):
    """`cp` truncates then writes: the watch may read the empty file, and the full one has the same mtime."""
    path, running, picker, watch = watched
    watch.poll()
    path.write_text("")
    stamp = path.stat().st_mtime_ns
    assert watch.poll() is False  # caught empty
    policy_file(path, "kv_affinity")
    os.utime(path, ns=(stamp, stamp))  # same modification time as the empty file
    assert watch.poll() is True and picker.policy.name == "kv_affinity"


def test_missing_file_keeps_the_scheduler(watched, caplog):
    path, running, picker, watch = watched
    watch.poll()
    path.unlink()  # an editor that replaces the file by renaming
    with caplog.at_level(logging.WARNING):
        assert watch.poll() is False
    assert caplog.records[-1].problem.startswith("cannot read") and picker.policy.name == "least_load"
    policy_file(path, "dynamo")
    assert watch.poll() is True and picker.policy.name == "dynamo"


def test_a_reload_switches_the_decode_policy_too(watched):
    path, running, picker, watch = watched
    path.write_text(yaml.safe_dump({"coordinator": {"scheduler": {"decode_policy": "round_robin"}}}))
    assert watch.poll() is True and picker.decode_policy.name == "round_robin"
    assert running.coordinator.scheduler.decode_policy == "round_robin"


async def test_watch_task_polls_the_file(watched):
    path, running, picker, _ = watched
    task = asyncio.create_task(watch_config(running, load_mesh_config, picker, None, interval_s=0.01))
    try:
        policy_file(path, "kv_affinity")
        await eventually(lambda: picker.policy.name == "kv_affinity", 5, "the reload")
        assert running.coordinator.scheduler.policy == "kv_affinity"
    finally:
        task.cancel()


def test_replicas_need_etcd_and_get_their_own_name_and_ports():
    with pytest.raises(ConfigError, match=r"coordinator.*etcd: required when replicas > 1"):
        parse_mesh_config({"coordinator": {"replicas": 2}}, "mesh.yaml")
    section = parse_mesh_config(
        {"coordinator": {"replicas": 3, "etcd": {"endpoint": "10.0.0.5:2379"}}}, "mesh.yaml"
    ).coordinator
    second = section.replica_config(2)
    assert (second.replica, second.listen, second.metrics_listen) == (
        "c2",
        "127.0.0.1:9120",
        "127.0.0.1:9121",
    )
    assert section.replica_endpoints == ["127.0.0.1:9100", "127.0.0.1:9110", "127.0.0.1:9120"]


def test_flow_control_keys_keep_each_tiers_defaults_and_bad_values_name_the_key():
    flow = parse_mesh_config(
        {
            "coordinator": {
                "flow_control": {"enabled": True, "flex": {"queue_ttl_s": 60, "refuse_late": False}}
            }
        }
    ).coordinator.flow_control
    assert flow.flex.queue_ttl_s == 60 and flow.flex.ttft_slo_s == 10.0  # the rest of flex's defaults
    assert not flow.slos()[Tier.FLEX].refuse_late and flow.slos()[Tier.DEFAULT].refuse_late
    assert flow.priority.admit_on_expiry and not flow.default.admit_on_expiry
    assert flow.max_wait_s == 60
    assert parse_mesh_config({}).coordinator.flow_control.max_wait_s == 0  # off by default
    for bad, key in (
        ({"flex": {"queue_ttl_s": -1}}, "coordinator.flow_control.flex.queue_ttl_s"),
        ({"default": {"ttft": 1}}, "coordinator.flow_control.default.ttft: unknown key"),
        ({"priority": {"max_queued": -1}}, "coordinator.flow_control.priority.max_queued"),
        ({"quantum_tokens": 0}, "coordinator.flow_control.quantum_tokens"),
    ):
        with pytest.raises(ConfigError) as info:
            parse_mesh_config({"coordinator": {"flow_control": bad}})
        assert key in str(info.value) and "\n" not in str(info.value)

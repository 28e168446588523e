"""The scheduler section: named policies, parameters, legacy keys, and reloads when the file changes."""

import asyncio
import logging

import pytest
import yaml

from coordinator.config_watch import watch_config
from mesh.config import ConfigError, load_mesh_config, parse_mesh_config
from tests.coordinator.test_picker import make_picker


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


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"policy": "nope"}, "unknown scheduling policy 'nope'"),
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


async def test_scheduler_reloads_when_the_file_changes(tmp_path, caplog):
    path = tmp_path / "mesh.yaml"
    path.write_text(yaml.safe_dump({"coordinator": {"scheduler": {"policy": "least_load"}}}))
    running = load_mesh_config(path)
    picker = make_picker()
    watcher = asyncio.create_task(watch_config(running, load_mesh_config, picker, None, interval_s=0.02))
    try:
        await asyncio.sleep(0.05)  # the watcher has read the file's first modification time
        path.write_text(yaml.safe_dump({"coordinator": {"scheduler": {"policy": "kv_affinity"}}}))
        for _ in range(200):
            if picker.policy.name == "kv_affinity":
                break
            await asyncio.sleep(0.01)
        assert picker.policy.name == "kv_affinity" and running.coordinator.scheduler.policy == "kv_affinity"
        with caplog.at_level(logging.ERROR):
            path.write_text("coordinator: {scheduler: {policy: nope}}\n")
            for _ in range(200):
                if any("reload failed" in r.getMessage() for r in caplog.records):
                    break
                await asyncio.sleep(0.01)
        assert picker.policy.name == "kv_affinity"  # a bad file keeps the running scheduler
    finally:
        watcher.cancel()

"""The backend registry: the built-in backends, an unknown name as a one-line config error, and a second backend
added by one module plus one registration, validated and launched through the normal path."""

from __future__ import annotations

import sys

import pytest

from mesh.config import ConfigError, parse_mesh_config
from node_agent.app import NodeAgent
from node_agent.backends import registry
from node_agent.config import EngineConfig
from node_agent.launch import LaunchError, build_launch
from node_agent.supervisor import EngineState
from tests.helpers import eventually, free_ports
from tests.node_agent.backends.fast_sim import TYPE, FastSimBackend
from tests.node_agent.test_supervision import FakeRegistry, serving


@pytest.fixture
def fast_sim(monkeypatch):
    """`simengine-fast` registered as a product backend would be, for this test only (the table is restored)."""
    monkeypatch.setattr(registry, "_BACKENDS", dict(registry._BACKENDS))
    registry.register(FastSimBackend())


@pytest.fixture
async def coordinator():
    """A fake coordinator Registry that records the instances registered with it."""
    async with serving(FakeRegistry()) as fake:
        yield fake


def test_builtin_backends_and_a_duplicate():
    assert registry.backend_types() == ["simengine", "vllm", "vllm-ascend"]
    assert [registry.get_backend(n).default_block_size for n in registry.backend_types()] == [16, 32, 128]
    with pytest.raises(ValueError, match="engine backend 'vllm' is registered twice"):
        registry.register(registry.get_backend("vllm"))


def test_an_unknown_backend_is_one_line_naming_the_key_and_the_known_ones():
    data = {"node_agents": [{"node_id": "n1", "engines": [{"instance_id": "e", "backend": "sglang", "model": "m",
                                                            "port": 7100}]}]}  # fmt: skip
    with pytest.raises(ConfigError) as info:
        parse_mesh_config(data, "mesh.yaml")
    assert str(info.value) == (
        "mesh.yaml: node_agents[0].engines[0].backend: unknown backend 'sglang'; known: simengine, vllm, vllm-ascend"
    )


def test_a_second_backend_is_validated_and_launched_through_the_normal_path(fast_sim):
    engine = EngineConfig(instance_id="f", backend=TYPE, model="m", port=8300, data_parallel_size=2,
                          kv_events=False, devices=[6, 7], role="decode")  # fmt: skip
    assert engine.block_size == 32  # the backend's default; no model_path or kv_connector asked for
    specs = build_launch(engine, "/run/tandem")
    assert [s.argv for s in specs] == [
        [sys.executable, "-m", "simengine", "--model", "m", "--speedup", "50", "--host", "127.0.0.1",
         "--port", str(8300 + rank), "--served-model-name", "m", "--block-size", "32",
         "--data-parallel-size", "2", "--data-parallel-rank", str(rank)]
        for rank in (0, 1)
    ]  # fmt: skip
    assert [s.env for s in specs] == [{"SIM_VISIBLE_DEVICES": "6"}, {"SIM_VISIBLE_DEVICES": "7"}]
    with pytest.raises(LaunchError, match="engine 'i': simengine-fast runs one process per DP rank"):
        build_launch(
            EngineConfig(instance_id="i", backend=TYPE, model="m", port=1, data_parallel_mode="internal"),
            "/r",
        )
    with pytest.raises(
        ValueError, match="unknown backend 'simengine-slow'; known: simengine, simengine-fast, vllm"
    ):
        EngineConfig(instance_id="s", backend="simengine-slow", model="m", port=1)


async def test_a_second_backend_runs_under_the_agent(fast_sim, coordinator, tmp_path):
    listen, metrics, port = free_ports(3)
    config = parse_mesh_config(
        {"node_agents": [{"node_id": "n1", "listen": f"127.0.0.1:{listen}", "metrics_listen": f"127.0.0.1:{metrics}",
                          "runtime_dir": str(tmp_path / "rt"), "probe_interval_s": 0.2,
                          "engines": [{"instance_id": "fast-0", "backend": TYPE, "model": "tandem-sim", "port": port,
                                       "kv_events": False}]}]},
        "mesh.yaml",
    ).node_agents[0]  # fmt: skip
    agent = NodeAgent(config, coordinator.address, "127.0.0.1:1")
    agent.prepare()
    sup = agent.supervisors["fast-0"]
    await agent.start()
    try:
        await eventually(lambda: sup.state is EngineState.RUNNING, 30, "running (ready on /ping)")
        await eventually(lambda: "fast-0" in coordinator.instances, 10, "registered")
        registered = coordinator.instances["fast-0"]
        assert (registered.backend, registered.block_size) == (TYPE, 32)
        assert "--speedup" in sup.spec.argv
        await eventually(lambda: sup.load.sampled_at > 0, 10, "load read from /metrics")
    finally:
        await agent.stop(stop_engines=True)

import pytest

from mesh.config import ConfigError, load_mesh_config, parse_mesh_config


def test_default_config_loads():
    mesh = load_mesh_config("configs/default.yaml")
    assert mesh.envoy.http_listen == "127.0.0.1:8000"
    assert [e.instance_id for e in mesh.node_agents[0].engines] == ["sim-0", "sim-1"]
    assert mesh.coordinator.scheduler.policy == "kv_affinity"


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (
            {"coordinator": {"scheduler": {"policy": "fastest"}}},
            "coordinator.scheduler: policy: unknown scheduling policy 'fastest'",
        ),
        ({"coordinator": {"listen": "nowhere"}}, "coordinator.listen: bad address 'nowhere'"),
        ({"envoy": {"http_port": 8000}}, "envoy.http_port: unknown key"),
        (
            {"node_agents": [{"node_id": "n", "engines": [{"instance_id": "a", "model": "m"}]}]},
            "node_agents[0].engines[0].port: Field required",
        ),
        (
            {
                "node_agents": [
                    {
                        "node_id": "n",
                        "engines": [
                            {"instance_id": "a", "model": "m", "port": 1},
                            {"instance_id": "a", "model": "m", "port": 2},
                        ],
                    }
                ]
            },
            "duplicate instance_id 'a'",
        ),
        (
            {
                "node_agents": [
                    {
                        "node_id": "n",
                        "engines": [{"instance_id": "a", "model": "m", "port": 1, "host": "0.0.0.0"}],
                    }
                ]
            },
            "wildcard",
        ),
        (
            {
                "node_agents": [
                    {
                        "node_id": "n",
                        "engines": [{"instance_id": "a", "model": "m", "port": 1, "backend": "vllm"}],
                    }
                ]
            },
            "model_path is required",
        ),
        ([1, 2], "expected a mapping"),
    ],
)
def test_bad_config_is_one_line_naming_the_key(data, message):
    with pytest.raises(ConfigError) as info:
        parse_mesh_config(data, "mesh.yaml")
    text = str(info.value)
    assert "\n" not in text and text.startswith("mesh.yaml: ")
    assert message in text


def test_unreadable_and_invalid_yaml(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        load_mesh_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("coordinator: [unclosed\n")
    with pytest.raises(ConfigError, match="invalid YAML"):
        load_mesh_config(bad)


@pytest.mark.parametrize(
    ("envoy", "pd_mode", "role", "path"),
    [
        ({}, "auto", "hybrid", "ext_authz"),  # aggregated only: the cheaper call
        ({}, "aggregated", "hybrid", "ext_authz"),
        ({}, "auto", "decode", "ext_proc"),  # a P/D engine: bodies are rewritten
        ({}, "prefill_handoff_decode", "hybrid", "ext_proc"),
        ({"decision": "ext_proc"}, "auto", "hybrid", "ext_proc"),  # as the operator says
    ],
)
def test_decision_path_follows_what_the_mesh_serves(envoy, pd_mode, role, path):
    engine = {"instance_id": "e0", "model": "m", "port": 8100, "role": role}
    if role != "hybrid":
        engine["kv_connector"] = "NixlConnector"
    mesh = parse_mesh_config(
        {
            "envoy": envoy,
            "coordinator": {"pd_mode": pd_mode},
            "node_agents": [{"node_id": "n1", "engines": [engine]}],
        }
    )
    assert mesh.decision_path == path

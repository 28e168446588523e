import pytest

from mesh.config import ConfigError, load_mesh_config, parse_mesh_config


def test_default_config_loads():
    mesh = load_mesh_config("configs/default.yaml")
    assert mesh.envoy.http_listen == "127.0.0.1:8000"
    assert [e.instance_id for e in mesh.node_agents[0].engines] == ["sim-0", "sim-1"]
    assert mesh.coordinator.scheduler.policy == "least_load"


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

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
        ({"coordinator": {"listen": "0.0.0.0:9100"}}, "coordinator: listen: '0.0.0.0:9100' is a wildcard"),
        (
            {"coordinator": {"replicas": 2, "etcd": {}, "replica_addresses": ["c-0.svc:9100"]}},
            "coordinator: replica_addresses: 1 addresses for 2 replicas",
        ),
        (
            {"conductor": {"replica_addresses": ["0.0.0.0:9200"]}},
            "conductor: replica_addresses: '0.0.0.0:9200'",
        ),
        ({"envoy": {"grpc_listen": "0.0.0.0:9000"}}, "envoy: grpc_address: required when grpc_listen"),
        (
            {"coordinator": {"topology": {"nodes": {"n1": {"nic": {"gbytes_per_s": 0}}}}}},
            "coordinator.topology.nodes.n1.nic.gbytes_per_s",
        ),
        (
            {"coordinator": {"topology": {"nodes": {"n1": {"preset": "tpu"}}}}},
            "coordinator.topology.nodes.n1.preset",
        ),
        (
            {
                "coordinator": {"topology": {"nodes": {"n9": {"rack": "r1"}}}},
                "node_agents": [{"node_id": "n1", "engines": []}],
            },
            "coordinator.topology.nodes.n9: no node agent has node_id 'n9' (known: n1)",
        ),
        (
            {"coordinator": {"topology": {"nodes": {"n1": {"intra": {"gbytes_per_s": -56}}}}}},
            "coordinator.topology.nodes.n1.intra.gbytes_per_s: Input should be greater than 0",
        ),
        (
            {"coordinator": {"topology": {"nodes": {"n1": {"nic": {"gbytes_per_s": 25, "latency_us": -1}}}}}},
            "coordinator.topology.nodes.n1.nic.latency_us",
        ),
        ({"coordinator": {"topology": {"preset": "tpu"}}}, "coordinator.topology.preset"),
        (
            {"coordinator": {"topology": {"nodes": {"n1": {"bandwidth": 25}}}}},
            "coordinator.topology.nodes.n1.bandwidth: unknown key",
        ),
        ({"coordinator": {"scheduler": {"pd_choice": "sometimes"}}}, "coordinator.scheduler.pd_choice"),
        (
            {"coordinator": {"scheduler": {"pd_joint": {"max_kv_usage": 0}}}},
            "max_kv_usage: must be in (0, 1]",
        ),
        ([1, 2], "expected a mapping"),
        (
            {"envoy": {"decision": "ext_authz"}, "coordinator": {"engine_priority": True}},
            "coordinator.engine_priority: needs envoy.decision ext_proc",
        ),
        (
            {"coordinator": {"tenants": [{"name": "a", "keys": ["k"]}, {"name": "a", "keys": ["j"]}]}},
            "coordinator.tenants: ",
        ),
        ({"tracing": {"otlp_endpoint": "collector:4317", "sample_ratio": 1.5}}, "tracing.sample_ratio: "),
        ({"tracing": {"otlp_endpoint": "collector"}}, "tracing.otlp_endpoint: "),
        (
            {"tracing": {"otlp_endpoint": "c:4317", "otlp_tls": True}},
            "tracing: ca_file: required with otlp_tls",
        ),
        ({"tracing": {"endpoint": "c:4317"}}, "tracing.endpoint: unknown key"),
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
    _check_decision_path(envoy, {"pd_mode": pd_mode}, role, path)


def test_engine_priority_needs_the_body_rewriting_path():
    _check_decision_path({}, {"engine_priority": True}, "hybrid", "ext_proc")


def _check_decision_path(envoy, coordinator, role, path):
    engine = {"instance_id": "e0", "model": "m", "port": 8100, "role": role}
    if role != "hybrid":
        engine["kv_connector"] = "NixlConnector"
    mesh = parse_mesh_config(
        {
            "envoy": envoy,
            "coordinator": coordinator,
            "node_agents": [{"node_id": "n1", "engines": [engine]}],
        }
    )
    assert mesh.decision_path == path


def test_replicas_on_different_hosts_bind_listen_and_are_reached_at_their_addresses():
    """Kubernetes: every replica binds the same wildcard port in its pod; the mesh dials each by its pod name, and
    agents and coordinators reach Envoy's control listener by its Service name."""
    mesh = parse_mesh_config(
        {
            "envoy": {"grpc_listen": "0.0.0.0:9000", "grpc_address": "envoy.tandem.svc:9000"},
            "coordinator": {
                "listen": "0.0.0.0:9100",
                "replicas": 2,
                "etcd": {"endpoint": "etcd:2379"},
                "replica_addresses": ["coordinator-0.coordinator:9100", "coordinator-1.coordinator:9100"],
            },
            "conductor": {"listen": "0.0.0.0:9200", "replica_addresses": ["conductor-0.conductor:9200"]},
        }
    )
    second = mesh.coordinator.replica_config(1)
    assert (second.replica, second.listen, second.metrics_listen) == ("c1", "0.0.0.0:9100", "127.0.0.1:9101")
    assert mesh.coordinator.replica_endpoints == [
        "coordinator-0.coordinator:9100",
        "coordinator-1.coordinator:9100",
    ]
    assert mesh.registry_address == "envoy.tandem.svc:9000"  # replicas: agents report through Envoy
    assert mesh.conductor_match_address == "conductor-0.conductor:9200"  # one conductor: matched directly
    assert mesh.conductor.replica_config(0).listen == "0.0.0.0:9200"


def test_tracing_is_off_by_default_and_names_its_collector():
    assert not parse_mesh_config({}, "mesh.yaml").tracing.enabled
    tracing = parse_mesh_config(
        {"tracing": {"otlp_endpoint": "otel.monitoring:4317", "sample_ratio": 0.5}}, "mesh.yaml"
    ).tracing
    assert tracing.enabled and tracing.endpoint_url == "http://otel.monitoring:4317"


def _lora_mesh(model: dict, engine: dict | None = None) -> dict:
    return {
        "models": [model],
        "node_agents": [
            {
                "node_id": "n",
                "engines": [{"instance_id": "e", "model": model["name"], "port": 7100, **(engine or {})}],
            }
        ],
    }


def test_model_adapters_and_max_loras_reach_its_engines():
    model = {"name": "m", "max_loras": 2, "adapters": [{"name": "sql", "path": "/a/sql"}, {"name": "chat",
             "path": "org/chat-lora", "max_rank": 64}]}  # fmt: skip
    engine = parse_mesh_config(_lora_mesh(model)).node_agents[0].engines[0]
    assert [(a.name, a.path, a.max_rank) for a in engine.adapters] == [
        ("sql", "/a/sql", None),
        ("chat", "org/chat-lora", 64),
    ]
    assert engine.max_loras == 2 and engine.lora_enabled
    own = parse_mesh_config(_lora_mesh(model, {"max_loras": 4, "adapters": [{"name": "x", "path": "/x"}]}))
    engine = own.node_agents[0].engines[0]
    assert engine.max_loras == 4 and [a.name for a in engine.adapters] == ["x"]
    plain = parse_mesh_config(_lora_mesh({"name": "m"})).node_agents[0].engines[0]
    assert not plain.lora_enabled and plain.max_loras is None


def test_adapter_paths_with_a_dot_are_taken_from_the_mesh_files_directory_and_preload_defaults_on(tmp_path):
    model = {"name": "m", "adapters": [{"name": "a", "path": "./adapters/a"}, {"name": "b", "path": "../b",
             "preload": False}, {"name": "h", "path": "org/h-lora"}]}  # fmt: skip
    config = parse_mesh_config(_lora_mesh(model), str(tmp_path / "dir" / "mesh.yaml"))
    paths = {a.name: (a.path, a.preload) for a in config.models[0].adapters}
    assert paths == {
        "a": (str(tmp_path / "dir" / "adapters" / "a"), True),
        "b": (str(tmp_path / "b"), False),
        "h": ("org/h-lora", True),  # a hub id, as it is
    }
    engine = config.node_agents[0].engines[0]
    assert [a.path for a in engine.adapters] == [paths["a"][0], paths["b"][0], "org/h-lora"]


@pytest.mark.parametrize(
    ("model", "engine", "message"),
    [
        ({"name": "m", "adapters": [{"name": "a"}]}, None, "models[0].adapters[0].path: Field required"),
        ({"name": "m", "adapters": [{"name": "a", "path": "/a", "rank": 8}]}, None,
         "models[0].adapters[0].rank: unknown key"),
        ({"name": "m", "adapters": [{"name": "a", "path": "/a", "max_rank": 1024}]}, None,
         "models[0].adapters[0].max_rank: 1024 is above vLLM's largest --max-lora-rank 512"),
        ({"name": "m", "adapters": [{"name": "a,b", "path": "/a"}]}, None,
         "models[0].adapters[0].name: 'a,b': an adapter name cannot contain ','"),
        ({"name": "m", "adapters": [{"name": "a", "path": "/a"}, {"name": "a", "path": "/b"}]}, None,
         "models[0]: adapters: duplicate name 'a'"),
        ({"name": "m", "adapters": [{"name": "m", "path": "/a"}]}, None, "models[0]: adapters: 'm' is the model's own"),
        ({"name": "m", "max_loras": 0}, None, "models[0].max_loras: Input should be greater than or equal to 1"),
        ({"name": "m"}, {"max_loras": 0}, "node_agents[0].engines[0].max_loras: Input should be greater than or"),
        ({"name": "m"}, {"args": ["--max-loras", "3"]},
         "engines[0]: engine 'e': args: --max-loras is set by the agent from adapters and max_loras"),
    ],
)  # fmt: skip
def test_adapter_config_errors_name_the_key(model, engine, message):
    with pytest.raises(ConfigError) as info:
        parse_mesh_config(_lora_mesh(model, engine))
    assert message in str(info.value) and "\n" not in str(info.value)


def test_adapter_named_like_another_model_is_refused():
    data = _lora_mesh({"name": "m", "adapters": [{"name": "other", "path": "/a"}]})
    data["models"].append({"name": "other"})
    with pytest.raises(ConfigError, match=r"models\[0\].adapters: 'other' is also a model's name"):
        parse_mesh_config(data)


def test_an_adapter_load_must_fit_in_the_ext_authz_decision_timer():
    model = {"name": "m", "adapters": [{"name": "a", "path": "/a"}]}
    slow = {**_lora_mesh(model), "coordinator": {"adapters": {"load_timeout_s": 6}}}
    with pytest.raises(ConfigError) as info:
        parse_mesh_config(slow)
    assert "coordinator.adapters.load_timeout_s: 6 s must be below envoy.ext_proc_timeout_ms (5 s)" in str(
        info.value
    )
    assert (
        parse_mesh_config({**slow, "envoy": {"decision": "ext_proc"}}).coordinator.adapters.load_timeout_s
        == 6
    )
    assert parse_mesh_config(_lora_mesh(model)).coordinator.adapters.load_timeout_s == 3

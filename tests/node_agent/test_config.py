"""Node agent config errors are one line naming the key (through the mesh loader, as a user sees them)."""

from __future__ import annotations

import pytest

from mesh.config import ConfigError, parse_mesh_config


def agent(engines=None, **fields) -> dict:
    return {"node_agents": [{"node_id": "n1", "engines": engines or [], **fields}]}


def ascend(**fields) -> dict:
    return {
        "instance_id": "e",
        "backend": "vllm-ascend",
        "model": "m",
        "model_path": "/m",
        "port": 7100,
        **fields,
    }


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (
            agent([ascend(tensor_parallel_size=3, nnodes=2)]),
            "engine 'e': nnodes 2 does not divide the world size",
        ),
        (
            agent([ascend(tensor_parallel_size=0)]),
            "node_agents[0].engines[0].tensor_parallel_size: Input should be",
        ),
        (agent([ascend(role="prefill")]), "engine 'e': role 'prefill' needs kv_connector"),
        (agent([ascend(role="decode", kv_connector="OffloadingConnector")]), "is not a P/D connector"),
        (agent([ascend(data_parallel_size=2)]), "kv_events_port is required with data_parallel_size > 1"),
        (
            agent(
                [
                    ascend(
                        data_parallel_size=2,
                        data_parallel_start_rank=1,
                        data_parallel_size_local=2,
                        kv_events=False,
                    )
                ]
            ),
            "exceeds data_parallel_size 2",
        ),  # fmt: skip
        (
            agent([ascend(tensor_parallel_size=8, devices=[0, 1, 2, 3])]),
            "devices lists 4 ids, the engine needs 8",
        ),
        (
            agent([ascend(nnodes=2, tensor_parallel_size=2, node_rank=2)]),
            "node_rank 2 must be below nnodes 2",
        ),
        (
            agent([ascend(role="prefill", kv_connector="MooncakeConnectorV1")]),
            "kv_connector_extra_config.decode.dp_size is required",
        ),  # fmt: skip
        (
            agent(
                [
                    ascend(
                        role="prefill",
                        tensor_parallel_size=8,
                        kv_connector="MooncakeConnectorV1",
                        kv_connector_extra_config={
                            "prefill": {"tp_size": 4},
                            "decode": {"dp_size": 1, "tp_size": 1},
                        },
                    )
                ]
            ),
            "kv_connector_extra_config.prefill.tp_size is 4 but the engine's own size is 8",
        ),  # fmt: skip
        (agent([ascend(kv_transfer_config={"kv_role": "kv_both"})]), "kv_transfer_config.kv_role is set by"),
        (
            agent([ascend(nnodes=2, tensor_parallel_size=2, data_parallel_size=2, kv_events_port=5000)]),
            "nnodes > 1 with data_parallel_size > 1 is not supported",
        ),  # fmt: skip
        (agent(services="engine,cache"), "node_agents[0].services: unknown service 'cache'"),
        (agent(services="kv_store"), "services names kv_store but there is no kv_store section"),
        (
            agent(services="engine,kv_store", kv_store={"mode": "separated"}),
            "kv_store.mode separated runs the store",
        ),
        (
            agent(services="kv_store", kv_store={"mode": "combined"}),
            "kv_store.mode combined runs engines too",
        ),
        (
            agent(kv_store={"mode": "both"}),
            "node_agents[0].kv_store.mode: Input should be 'combined' or 'separated'",
        ),
        (
            agent([ascend(data_parallel_size=2, kv_events_port=5000), ascend(instance_id="f", port=7101)]),
            "two engines on 127.0.0.1:7101",
        ),  # fmt: skip
    ],
)
def test_bad_engine_config_is_one_line_naming_the_key(data, message):
    with pytest.raises(ConfigError) as info:
        parse_mesh_config(data, "mesh.yaml")
    text = str(info.value)
    assert "\n" not in text and text.startswith("mesh.yaml: ")
    assert message in text, text


def test_defaults_and_placeholders():
    mesh = parse_mesh_config(
        agent([ascend(nnodes=2, tensor_parallel_size=8, node_rank="${NODE_RANK}", master_addr="$MASTER")]),
        "m.yaml",
    )
    e = mesh.node_agents[0].engines[0]
    assert (e.node_rank, e.master_addr, e.block_size, e.local_world_size, e.kv_role) == (
        None,
        None,
        128,
        4,
        "kv_both",
    )
    assert mesh.node_agents[0].service_names == ["engine"]
    both = parse_mesh_config(agent(services="engine, kv_store", kv_store={}), "m.yaml").node_agents[0]
    assert both.service_names == ["kv_store", "engine"] and both.kv_store.argv[0] == "mooncake_master"

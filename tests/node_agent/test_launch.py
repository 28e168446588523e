"""Golden tests of the engine launch commands: every flag and variable of each topology, exactly."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest

from node_agent.config import EngineConfig
from node_agent.coordinator_link import dispatch_capability
from node_agent.launch import LaunchError, Placement, build_launch
from tandem.v1 import common_pb2

RUN = "/run/tandem"
#: Every backend's processes for a table of layouts, exactly as launched before backends became plug-ins
#: (`node_agent.backends`); the agent's own interpreter is written `<agent python>`.
GOLDEN = json.loads((Path(__file__).parent / "golden" / "launch.json").read_text())


def engine(**fields) -> EngineConfig:
    base = {"backend": "vllm-ascend", "model": "ds-r1", "model_path": "/models/ds-r1", "port": 7100}
    return EngineConfig.model_validate({**base, **fields})


def split(argv: list[str]) -> tuple[list[str], dict, dict | None]:
    """argv without the two JSON values, the parsed --kv-transfer-config and --kv-events-config."""
    out, transfer, events = [], None, None
    it = iter(argv)
    for arg in it:
        if arg == "--kv-transfer-config":
            transfer = json.loads(next(it))
        elif arg == "--kv-events-config":
            events = json.loads(next(it))
        else:
            out.append(arg)
    return out, transfer, events


def test_ascend_prefill_tp8_one_node():
    e = engine(
        instance_id="p0",
        host="10.0.0.1",
        role="prefill",
        tensor_parallel_size=8,
        devices=list(range(8)),
        kv_connector="MooncakeConnectorV1",
        kv_port=36000,
        kv_connector_extra_config={"decode": {"dp_size": 4, "tp_size": 2}, "use_ascend_direct": True},
    )
    [spec] = build_launch(e, RUN)
    argv, transfer, events = split(spec.argv)
    assert argv == [
        "vllm", "serve", "/models/ds-r1",
        "--host", "10.0.0.1", "--port", "7100",
        "--served-model-name", "ds-r1", "--block-size", "128",
        "--tensor-parallel-size", "8",
    ]  # fmt: skip
    assert transfer == {
        "kv_connector": "MooncakeConnectorV1",
        "kv_role": "kv_producer",
        "engine_id": "p0",
        "kv_port": 36000,
        "kv_connector_extra_config": {
            "use_ascend_direct": True,
            "prefill": {"dp_size": 1, "tp_size": 8},
            "decode": {"dp_size": 4, "tp_size": 2},
        },
    }
    assert events == {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": "ipc:///run/tandem/p0-kv.sock",
        "replay_endpoint": "ipc:///run/tandem/p0-kv-replay.sock",
        "topic": "kv-events",
    }
    assert spec.env == {"ASCEND_RT_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}
    assert (spec.name, spec.port, spec.data_parallel_size) == ("p0", 7100, 1)
    assert [(s.dp_rank, s.endpoint) for s in spec.kv_events] == [(0, "ipc:///run/tandem/p0-kv.sock")]
    assert dispatch_capability(e) == common_pb2.DISPATCH_CAPABILITY_HANDOFF


def test_ascend_decode_dp4_tp2_one_api_server_per_rank():
    e = engine(
        instance_id="d0",
        host="10.0.0.2",
        port=7200,
        role="decode",
        tensor_parallel_size=2,
        data_parallel_size=4,
        data_parallel_rpc_port=12321,
        devices=list(range(8)),
        kv_connector="MooncakeConnectorV1",
        kv_port=36200,
        kv_events_port=5600,
        kv_connector_extra_config={"prefill": {"dp_size": 1, "tp_size": 8}},
    )
    specs = build_launch(e, RUN)
    assert [s.name for s in specs] == ["d0-dp0", "d0-dp1", "d0-dp2", "d0-dp3"]
    for rank, spec in enumerate(specs):
        argv, transfer, events = split(spec.argv)
        assert argv == [
            "vllm", "serve", "/models/ds-r1",
            "--host", "10.0.0.2", "--port", str(7200 + rank),
            "--served-model-name", "ds-r1", "--block-size", "128",
            "--tensor-parallel-size", "2",
            "--data-parallel-size", "4", "--data-parallel-rank", str(rank),
            "--data-parallel-address", "10.0.0.2", "--data-parallel-rpc-port", "12321",
        ]  # fmt: skip
        # Same kv_port for every rank: vLLM-Ascend adds dp_rank * tp itself.
        assert (
            transfer["kv_port"] == 36200
            and transfer["engine_id"] == "d0"
            and transfer["kv_role"] == "kv_consumer"
        )
        assert transfer["kv_connector_extra_config"] == {
            "prefill": {"dp_size": 1, "tp_size": 8},
            "decode": {"dp_size": 4, "tp_size": 2},
        }
        # Every rank gets the same base endpoints; vLLM adds the rank to tcp ports.
        assert events["endpoint"] == "tcp://*:5600" and events["replay_endpoint"] == "tcp://*:5604"
        assert [(s.dp_rank, s.endpoint, s.replay_endpoint) for s in spec.kv_events] == [
            (rank, f"tcp://127.0.0.1:{5600 + rank}", f"tcp://127.0.0.1:{5604 + rank}")
        ]
        assert spec.env == {"ASCEND_RT_VISIBLE_DEVICES": f"{2 * rank},{2 * rank + 1}"}
        assert spec.port == 7200 + rank and spec.data_parallel_size == 1 and spec.dp_ranks == (rank,)


@pytest.mark.parametrize("node_rank", [0, 1])
def test_ascend_prefill_tp16_pp2_across_two_nodes(node_rank):
    e = engine(
        instance_id="p1",
        host="10.0.0.3",
        role="prefill",
        tensor_parallel_size=16,
        pipeline_parallel_size=2,
        nnodes=2,
        node_rank="${NODE_RANK}",  # placeholder, injected at run time
        master_addr="${MASTER_ADDR}",
        master_port=29600,
        devices=list(range(16)),
        kv_connector="MooncakeConnectorV1",
        kv_port=36000,
        kv_connector_extra_config={
            "prefill": {"pp_layer_partition": "32,29"},
            "decode": {"dp_size": 1, "tp_size": 1, "pp_size": 1},
        },
    )
    assert e.local_world_size == 16
    [spec] = build_launch(e, RUN, Placement(node_rank=node_rank, master_addr="10.0.0.3"))
    argv, transfer, events = split(spec.argv)
    head = ["--host", "10.0.0.3", "--port", "7100"] if node_rank == 0 else []
    assert argv == [
        "vllm", "serve", "/models/ds-r1", *head,
        "--served-model-name", "ds-r1", "--block-size", "128",
        "--tensor-parallel-size", "16", "--pipeline-parallel-size", "2",
        "--distributed-executor-backend", "mp", "--nnodes", "2", "--node-rank", str(node_rank),
        "--master-addr", "10.0.0.3", "--master-port", "29600",
        *(["--headless"] if node_rank else []),
    ]  # fmt: skip
    assert transfer["kv_connector_extra_config"] == {
        "prefill": {"pp_layer_partition": "32,29", "dp_size": 1, "tp_size": 16, "pp_size": 2},
        "decode": {"dp_size": 1, "tp_size": 1, "pp_size": 1},
    }
    assert spec.env == {
        "ASCEND_RT_VISIBLE_DEVICES": ",".join(str(i) for i in range(16)),
        "VLLM_PP_LAYER_PARTITION": "32,29",
    }
    if node_rank == 0:
        assert spec.name == "p1" and spec.port == 7100 and events["endpoint"].startswith("ipc://")
    else:  # headless: no API server, nothing to register, no scheduler publishing events
        assert spec.name == "p1-node1" and spec.headless and events is None and spec.kv_events == ()


def test_runtime_placement_overrides_config_and_is_required():
    fields = dict(instance_id="x", tensor_parallel_size=8, pipeline_parallel_size=2, nnodes=2)
    [spec] = build_launch(
        engine(**fields, node_rank=0, master_addr="10.9.9.9"), RUN, Placement(1, "10.0.0.5")
    )
    assert "--headless" in spec.argv and spec.argv[spec.argv.index("--master-addr") + 1] == "10.0.0.5"
    with pytest.raises(LaunchError, match="engine 'x': node_rank is not set .*TANDEM_NODE_RANK"):
        build_launch(engine(**fields), RUN, Placement(master_addr="10.0.0.5"))
    with pytest.raises(LaunchError, match="master_addr is not set"):
        build_launch(engine(**fields), RUN, Placement(node_rank=0))
    assert Placement.from_env({"TANDEM_NODE_RANK": "1", "TANDEM_MASTER_ADDR": "10.0.0.1"}) == Placement(
        1, "10.0.0.1"
    )


def test_layerwise_trigger_pair():
    extra = {"prefill": {"dp_size": 2, "tp_size": 8}, "decode": {"dp_size": 2, "tp_size": 4}}
    p = engine(instance_id="lp", role="prefill", tensor_parallel_size=8, data_parallel_size=2, kv_events_port=5700,
               kv_connector="MooncakeLayerwiseConnector", kv_port=36000, kv_connector_extra_config=extra)  # fmt: skip
    d = engine(instance_id="ld", role="decode", port=7200, tensor_parallel_size=4, data_parallel_size=2,
               kv_events_port=5800, kv_connector="MooncakeLayerwiseConnector", kv_port=36200,
               kv_connector_extra_config=extra)  # fmt: skip
    for e, role in ((p, "kv_producer"), (d, "kv_consumer")):
        assert dispatch_capability(e) == common_pb2.DISPATCH_CAPABILITY_TRIGGER
        specs = build_launch(e, RUN)
        assert len(specs) == 2
        for rank, spec in enumerate(specs):
            _, transfer, _ = split(spec.argv)
            assert transfer == {
                "kv_connector": "MooncakeLayerwiseConnector",
                "kv_role": role,
                "engine_id": e.instance_id,
                "kv_port": e.kv_port,
                "kv_connector_extra_config": extra,
            }
            assert spec.argv[spec.argv.index("--data-parallel-rank") + 1] == str(rank)


def test_non_divisible_topology_is_a_config_error_naming_the_values():
    with pytest.raises(ValueError) as info:
        engine(instance_id="bad", tensor_parallel_size=3, pipeline_parallel_size=1, nnodes=2)
    message = str(info.value)
    assert "engine 'bad': nnodes 2 does not divide the world size of a DP rank" in message
    assert "tensor_parallel_size 3" in message and "= 3" in message


def test_cpu_vllm_example_connector_pair():
    common = dict(backend="vllm", model="tiny", model_path="/m/tiny", python="/venv/bin/python",
                  kv_connector="ExampleConnector")  # fmt: skip
    p = EngineConfig(instance_id="p", port=8201, role="prefill", **common)
    d = EngineConfig(instance_id="d", port=8202, role="decode", **common)
    for e, role in ((p, "kv_producer"), (d, "kv_consumer")):
        [spec] = build_launch(e, RUN)
        argv, transfer, _ = split(spec.argv)
        assert argv == [
            "/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server", "--model", "/m/tiny",
            "--host", "127.0.0.1", "--port", str(e.port), "--served-model-name", "tiny", "--block-size", "32",
        ]  # fmt: skip
        assert transfer == {
            "kv_connector": "ExampleConnector",
            "kv_role": role,
            "engine_id": e.instance_id,
            "kv_connector_extra_config": {"shared_storage_path": "/run/tandem/kv-shared"},
        }
        assert spec.env == {} and dispatch_capability(e) == common_pb2.DISPATCH_CAPABILITY_HANDOFF


def test_simengine_keeps_its_flags_and_dp_ranks():
    [spec] = build_launch(
        EngineConfig(instance_id="s", model="tandem-sim", port=8101, args=["--speedup", "20"]), RUN
    )
    argv, transfer, events = split(spec.argv)
    assert argv == [
        sys.executable, "-m", "simengine", "--model", "tandem-sim", "--host", "127.0.0.1", "--port", "8101",
        "--served-model-name", "tandem-sim", "--block-size", "16", "--speedup", "20",
    ]  # fmt: skip
    assert transfer is None and events["endpoint"] == "ipc:///run/tandem/s-kv.sock"
    dp = EngineConfig(instance_id="s", model="m", port=8101, data_parallel_size=2, kv_events_port=5900)
    assert [s.argv[s.argv.index("--data-parallel-rank") + 1] for s in build_launch(dp, RUN)] == ["0", "1"]
    aggregated = EngineConfig(instance_id="s", model="m", port=1)
    assert dispatch_capability(aggregated) == common_pb2.DISPATCH_CAPABILITY_AGGREGATED


def test_internal_dp_and_headless_secondary_node():
    fields = dict(instance_id="i", tensor_parallel_size=2, data_parallel_size=4, data_parallel_size_local=2,
                  data_parallel_mode="internal", data_parallel_address="10.0.0.1", data_parallel_rpc_port=13345,
                  kv_events_port=5600)  # fmt: skip
    [head] = build_launch(engine(**fields), RUN)
    assert split(head.argv)[0][-8:] == [
        "--data-parallel-size", "4", "--data-parallel-size-local", "2",
        "--data-parallel-address", "10.0.0.1", "--data-parallel-rpc-port", "13345",
    ]  # fmt: skip
    assert head.data_parallel_size == 2 and [s.dp_rank for s in head.kv_events] == [0, 1]
    [second] = build_launch(engine(**fields, data_parallel_start_rank=2), RUN)
    assert second.headless and "--headless" in second.argv and "--port" not in second.argv
    assert second.argv[second.argv.index("--data-parallel-start-rank") + 1] == "2"
    # Its ranks' schedulers run here and publish here; the events belong to the head node's instance.
    assert [s.dp_rank for s in second.kv_events] == [2, 3] and second.events_instance == "i"


def test_registered_instance_ids():
    from node_agent.launch import registered_instance_ids

    assert registered_instance_ids(engine(instance_id="a")) == ["a"]
    dp = engine(instance_id="d", data_parallel_size=2, kv_events_port=5600)
    assert registered_instance_ids(dp) == ["d-dp0", "d-dp1"]
    pp = engine(instance_id="p", tensor_parallel_size=8, nnodes=2)
    assert registered_instance_ids(pp, Placement(1, "10.0.0.1")) == []


@pytest.mark.parametrize("case", sorted(GOLDEN))
def test_every_backend_launches_each_layout_as_the_golden_table(case):
    entry = GOLDEN[case]
    placement = Placement(*entry["placement"]) if entry["placement"] else Placement()
    engine = EngineConfig.model_validate(entry["engine"])
    try:
        specs = build_launch(engine, RUN, placement)
    except LaunchError as exc:
        assert entry["launch"] == {"error": str(exc)}
        return
    seen = []
    for spec in specs:
        fields = dataclasses.asdict(spec)
        fields["argv"] = ["<agent python>" if a == sys.executable else a for a in spec.argv]
        fields["dp_ranks"] = list(spec.dp_ranks)
        fields["kv_events"] = [[s.dp_rank, s.endpoint, s.replay_endpoint] for s in spec.kv_events]
        seen.append(fields)
    assert seen == entry["launch"]


@pytest.mark.parametrize("backend", ["vllm", "vllm-ascend", "simengine"])
def test_lora_flags_and_runtime_variable(backend):
    adapters = [{"name": "a", "path": "/a"}, {"name": "b", "path": "/b", "max_rank": 20},
                {"name": "c", "path": "/c"}]  # fmt: skip
    spec = build_launch(engine(instance_id="l", backend=backend, adapters=adapters, max_loras=2), RUN)[0]
    argv = spec.argv
    at = argv.index("--enable-lora")
    # rank 20 needs vLLM's next value, 32; every configured adapter stays in memory (3 > max_loras 2)
    assert argv[at : at + 7] == [
        "--enable-lora",
        "--max-loras",
        "2",
        "--max-lora-rank",
        "32",
        "--max-cpu-loras",
        "3",
    ]
    assert spec.env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    only_slots = build_launch(engine(instance_id="l", backend=backend, max_loras=1), RUN)[0]
    assert (
        "--max-lora-rank" in only_slots.argv
        and only_slots.argv[only_slots.argv.index("--max-lora-rank") + 1] == "16"
    )
    plain = build_launch(engine(instance_id="l", backend=backend), RUN)[0]
    assert "--enable-lora" not in plain.argv and "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in plain.env

"""`tandem import-vllm` on real-looking vLLM-Ascend launch scripts (tests/mesh/fixtures/vllm_scripts/)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from mesh.cli import main as cli
from mesh.import_vllm import ImportError_, import_script
from node_agent.config import NodeAgentConfig
from node_agent.launch import Placement, build_launch

SCRIPTS = Path(__file__).parent / "fixtures" / "vllm_scripts"


def imported(name: str, *args: str) -> list[dict]:
    entry = import_script((SCRIPTS / name).read_text(), list(args))
    NodeAgentConfig.model_validate(entry)  # what it prints is valid agent config
    return entry["engines"]


def test_prefill_dp_template_with_launcher_arguments():
    [engine] = imported(
        "prefill_dp_template.sh", "8,9,10,11,12,13,14,15", "7101", "2", "1", "192.0.0.1", "12321", "8"
    )
    assert engine == {
        "instance_id": "prefill-0",
        "backend": "vllm-ascend",
        "model": "ds_r1",
        "model_path": "/path_to_weight/DeepSeek-r1_w8a8_mtp",
        "host": "192.0.0.1",  # --host 0.0.0.0 cannot be reached: HCCL_IF_IP, via $local_ip
        "port": 7101,
        "role": "prefill",
        "data_parallel_size": 2,
        "data_parallel_start_rank": 1,
        "data_parallel_size_local": 1,
        "data_parallel_rpc_port": 12321,
        "tensor_parallel_size": 8,
        "kv_connector": "MooncakeConnectorV1",
        "kv_port": 36000,
        # the prefill side's sizes are stripped (the agent fills them in); the decode side stays
        "kv_connector_extra_config": {"decode": {"dp_size": 32, "tp_size": 1}},
        "kv_events_port": 5557,
        "devices": [8, 9, 10, 11, 12, 13, 14, 15],
        "env": {
            "HCCL_IF_IP": "192.0.0.1",
            "GLOO_SOCKET_IFNAME": "eth0",
            "TP_SOCKET_IFNAME": "eth0",
            "HCCL_SOCKET_IFNAME": "eth0",
            "OMP_PROC_BIND": "false",
            "OMP_NUM_THREADS": "10",
            "PYTORCH_NPU_ALLOC_CONF": "expandable_segments:True",
            "HCCL_BUFFSIZE": "256",
            "TASK_QUEUE_ENABLE": "1",
        },
        "args": [
            "--enable-expert-parallel", "--seed", "1024", "--max-model-len", "40000",
            "--max-num-batched-tokens", "16384", "--max-num-seqs", "8", "--enforce-eager", "--trust-remote-code",
            "--gpu-memory-utilization", "0.9", "--quantization", "ascend", "--no-enable-prefix-caching",
            "--speculative-config", '{"num_speculative_tokens": 1, "method":"deepseek_mtp"}',
        ],
    }  # fmt: skip


def test_command_line_sizes_win_over_the_connector_config():
    [engine] = imported("decode_dp4_tp2.sh")
    # The script says -dp 4 / TP 2, its connector config says decode dp_size 8 / tp_size 4: the command line wins.
    assert engine["data_parallel_size"] == 4 and engine["tensor_parallel_size"] == 2
    assert engine["kv_connector_extra_config"] == {
        "use_ascend_direct": True,
        "prefill": {"dp_size": 2, "tp_size": 8},
    }
    assert (engine["data_parallel_start_rank"], engine["data_parallel_size_local"], engine["devices"]) == (
        0,
        1,
        [0, 1],
    )
    assert engine["kv_events_port"] == 5557 and engine["role"] == "decode" and engine["model"] == "qwen3-235b"
    assert engine["model_path"] == "/data/models/Qwen3-235B-A22B-W8A8"  # ${MODEL}
    assert "engine_id" not in str(engine) and "data_parallel_address" not in engine
    # The agent's own command for it carries the sizes back into the connector config.
    [spec] = build_launch(
        NodeAgentConfig.model_validate({"node_id": "n", "engines": [engine]}).engines[0], "/run"
    )
    transfer = spec.argv[spec.argv.index("--kv-transfer-config") + 1]
    assert '"decode":{"dp_size":4,"tp_size":2}' in transfer and '"engine_id":"decode-0"' in transfer


@pytest.mark.parametrize("script", ["prefill_pp_cross_node.sh", "prefill_pp_worker.sh"])
def test_cross_node_scripts_give_nnodes_and_master_port_never_address_or_rank(script):
    [engine] = imported(script)
    assert engine["nnodes"] == 2 and engine["master_port"] == 29600
    assert {"master_addr", "node_rank"}.isdisjoint(engine)
    assert "--headless" not in engine.get("args", []) and "--distributed-executor-backend" not in engine.get(
        "args", []
    )
    assert (engine["tensor_parallel_size"], engine["pipeline_parallel_size"]) == (8, 2)
    assert engine["kv_connector_extra_config"] == {
        "prefill": {"pp_layer_partition": "32,29"},
        "decode": {"dp_size": 1, "tp_size": 1, "pp_size": 1},
    }
    assert "VLLM_PP_LAYER_PARTITION" not in engine["env"]  # the agent exports it from the connector config
    config = NodeAgentConfig.model_validate({"node_id": "n", "engines": [engine]}).engines[0]
    rank = 0 if script == "prefill_pp_cross_node.sh" else 1
    [spec] = build_launch(config, "/run", Placement(node_rank=rank, master_addr="10.0.0.1"))
    assert spec.headless == bool(rank) and spec.env["VLLM_PP_LAYER_PARTITION"] == "32,29"


def test_layerwise_pair_in_one_script():
    prefill, decode = imported("layerwise_pair.sh")
    assert (prefill["instance_id"], decode["instance_id"]) == ("prefill-0", "decode-0")
    assert prefill["tensor_parallel_size"] == 8  # none on its command line: taken from the connector config
    assert decode["tensor_parallel_size"] == 4  # command line 4 wins over the connector config's 2
    assert prefill["kv_connector_extra_config"] == {"decode": {"dp_size": 1, "tp_size": 4}}
    assert decode["kv_connector_extra_config"] == {"prefill": {"dp_size": 1, "tp_size": 8}}
    assert (prefill["devices"], decode["devices"]) == (list(range(8)), [8, 9, 10, 11])
    assert prefill["args"] == decode["args"] == ["--trust-remote-code"]  # `&` is the shell's, not vLLM's
    assert {prefill["kv_connector"], decode["kv_connector"]} == {"MooncakeLayerwiseConnector"}


def test_cpu_script_is_the_vllm_backend():
    [engine] = imported("cpu_example_connector.sh")
    assert engine == {
        "instance_id": "decode-0",
        "backend": "vllm",
        "model": "tiny",
        "model_path": "/srv/models/tiny",
        "host": "127.0.0.1",
        "port": 8202,
        "role": "decode",
        "block_size": 32,
        "kv_connector": "ExampleConnector",
        "kv_connector_extra_config": {"shared_storage_path": "/srv/kv"},
        "env": {"VLLM_CPU_KVCACHE_SPACE": "1"},
        "args": ["--enforce-eager"],
    }


def test_cli_prints_yaml_and_errors_are_one_line(capsys, tmp_path):
    assert cli(["import-vllm", str(SCRIPTS / "layerwise_pair.sh"), "--node-id", "npu-7"]) == 0
    out = yaml.safe_load(capsys.readouterr().out)
    assert out["node_agents"][0]["node_id"] == "npu-7" and len(out["node_agents"][0]["engines"]) == 2
    assert cli(["import-vllm", str(SCRIPTS / "prefill_dp_template.sh")]) == 2
    err = capsys.readouterr().err
    assert (
        err.count("\n") == 1 and "--port '$2' is not a number (pass the script's arguments after it)" in err
    )
    empty = tmp_path / "empty.sh"
    empty.write_text("echo hello\n")
    assert cli(["import-vllm", str(empty)]) == 2
    assert "no `vllm serve` command found" in capsys.readouterr().err
    with pytest.raises(ImportError_, match="invalid JSON"):
        import_script("vllm serve /m --kv-transfer-config '{nope'")

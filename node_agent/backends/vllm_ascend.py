"""`vllm-ascend`: vLLM with the Ascend plugin on NPUs. vLLM's flags (`vllm.VllmBackend`), started as `vllm serve`,
devices through `ASCEND_RT_VISIBLE_DEVICES` (vLLM-Ascend's external-DP launcher sets it per rank), block size 128
(its default).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from node_agent.backends.vllm import VllmBackend

if TYPE_CHECKING:
    from node_agent.config import EngineConfig

TYPE = "vllm-ascend"


class VllmAscendBackend(VllmBackend):
    """vLLM-Ascend: vLLM's flags with its own program, device variable and block size."""

    name = TYPE
    default_block_size = 128
    devices_variable = "ASCEND_RT_VISIBLE_DEVICES"

    def program(self, engine: EngineConfig) -> list[str]:
        """`vllm serve` from PATH; with `python`, the module behind the `vllm` console script
        (vllm.entrypoints.cli.main:main), which runs under `-m` too."""
        if engine.python:
            return [engine.python, "-m", "vllm.entrypoints.cli.main", "serve", str(engine.model_path)]
        return ["vllm", "serve", str(engine.model_path)]

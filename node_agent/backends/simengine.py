"""`simengine`: Tandem's simulated engine (`python -m simengine`), vLLM's API and metrics on the CPU without weights.

One process per DP rank (it has no internal DP load balancing and no cross-node ranks); it takes `--tokenizer` and
tensor parallelism only as a cost model; P/D roles work without a KV connector (simengine hands KV over itself).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from node_agent.backends.interface import KV_HOST_ENV, ProcessLayout
from tandem.engine_load import EngineLoad, parse_load

if TYPE_CHECKING:
    from node_agent.config import EngineConfig

TYPE = "simengine"


class SimengineBackend:
    """The simulated engine."""

    name = TYPE
    default_block_size = 16
    needs_model_path = False
    pd_needs_connector = False
    health_path = "/health"

    def check(self, engine: EngineConfig) -> str | None:
        """Several ranks behind one API server, or a rank over several nodes, is not simulated."""
        if engine.nnodes > 1 or (engine.data_parallel_mode == "internal" and engine.data_parallel_size > 1):
            return "simengine runs one process per DP rank: use data_parallel_mode external, nnodes 1"
        return None

    def program(self, engine: EngineConfig) -> list[str]:
        return [engine.python or sys.executable, "-m", "simengine", "--model", engine.model]

    def model_args(self, engine: EngineConfig) -> list[str]:
        return ["--tokenizer", engine.tokenizer] if engine.tokenizer else []

    def parallel_args(self, engine: EngineConfig, layout: ProcessLayout) -> list[str]:
        """TP (its cost model) and, in external DP, the rank: simengine takes no other parallel flag."""
        argv: list[str] = []
        if engine.tensor_parallel_size > 1:
            argv += ["--tensor-parallel-size", str(engine.tensor_parallel_size)]
        if layout.external:
            argv += ["--data-parallel-size", str(engine.data_parallel_size)]
            argv += ["--data-parallel-rank", str(layout.ranks[0])]
        return argv

    def devices_env(self, devices: Sequence[int]) -> dict[str, str]:
        """No accelerators: nothing to make visible."""
        return {}

    def kv_host_env(self, engine: EngineConfig) -> dict[str, str]:
        """Every simengine connector's KV listener takes its host from vLLM's NIXL variable."""
        return {KV_HOST_ENV: engine.host} if engine.kv_connector else {}

    def read_load(self, metrics: str) -> EngineLoad:
        """simengine publishes vLLM's metric names."""
        return parse_load(metrics)

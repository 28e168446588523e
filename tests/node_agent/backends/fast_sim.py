"""A second simulated backend, for tests only: simengine at 50x speed under another name, with its own block size,
device variable and readiness path. It is what a new backend's module looks like: the interface's members and
nothing else of the agent; registering it is the one other line (`register(FastSimBackend())`)."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from node_agent.backends.interface import KV_HOST_ENV, ProcessLayout
from tandem.engine_load import EngineLoad, parse_load

if TYPE_CHECKING:
    from node_agent.config import EngineConfig

TYPE = "simengine-fast"


class FastSimBackend:
    """simengine with `--speedup 50`, block size 32, `SIM_VISIBLE_DEVICES`, ready when `/ping` answers."""

    name = TYPE
    default_block_size = 32
    needs_model_path = False
    pd_needs_connector = False
    health_path = "/ping"

    def check(self, engine: EngineConfig) -> str | None:
        if engine.nnodes > 1 or engine.data_parallel_mode == "internal":
            return "simengine-fast runs one process per DP rank: use data_parallel_mode external, nnodes 1"
        return None

    def program(self, engine: EngineConfig) -> list[str]:
        return [sys.executable, "-m", "simengine", "--model", engine.model, "--speedup", "50"]

    def model_args(self, engine: EngineConfig) -> list[str]:
        return []

    def parallel_args(self, engine: EngineConfig, layout: ProcessLayout) -> list[str]:
        if not layout.external:
            return []
        return [
            "--data-parallel-size",
            str(engine.data_parallel_size),
            "--data-parallel-rank",
            str(layout.ranks[0]),
        ]

    def devices_env(self, devices: Sequence[int]) -> dict[str, str]:
        return {"SIM_VISIBLE_DEVICES": ",".join(str(d) for d in devices)}

    def kv_host_env(self, engine: EngineConfig) -> dict[str, str]:
        return {KV_HOST_ENV: engine.host} if engine.kv_connector else {}

    def read_load(self, metrics: str) -> EngineLoad:
        return parse_load(metrics)

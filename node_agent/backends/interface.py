"""The engine backend plug-in interface: what differs between the engines the agent launches. Nothing else lives
here.

The framework lays an engine's processes out over DP ranks and nodes and assembles each command line
(`node_agent.launch`): the backend's program, `--host`/`--port` (not on a headless process),
`--served-model-name`/`--block-size`, the backend's model and parallel arguments, `--kv-transfer-config`,
`--kv-events-config`, then the user's `args`; the environment is the backend's device variable, the PP layer
partition and the user's `env`. The config (`node_agent.config`) asks the backend for its default block size and
what an engine of it requires; the supervisor asks it where readiness is read and how the engine's `/metrics` name
its load. Backends are stateless and pure: same engine, same answers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from tandem.engine_load import EngineLoad

if TYPE_CHECKING:  # the config asks the registry to validate `backend:`, so it cannot be imported at run time
    from node_agent.config import EngineConfig


@dataclass(frozen=True, slots=True)
class ProcessLayout:
    """Where one engine process sits in its engine's parallel layout (decided by `node_agent.launch`)."""

    ranks: tuple[int, ...]  # the DP ranks this process runs (one in external DP load balancing)
    external: bool  # external DP load balancing: one API server per rank (`--data-parallel-rank`)
    headless: bool  # no API server: node rank > 0 of a cross-node rank, or an internal-DP node past rank 0
    node_rank: int  # this node's rank within a DP rank spanning nodes; 0 otherwise
    master_addr: str | None  # the first node of a DP rank spanning nodes (None on one node)


#: Where vLLM's NixlConnector (and every simengine connector) binds its KV side channel and what it announces.
KV_HOST_ENV = "VLLM_NIXL_SIDE_CHANNEL_HOST"


class Backend(Protocol):
    """An engine the agent can launch (`backend:` in an engine's config)."""

    name: str  # the `backend:` value; also reported to the coordinator at registration
    #: `--block-size` when the config sets none (the engine and the conductor must agree).
    default_block_size: int
    needs_model_path: bool  # the engine loads weights from `model_path`, which is then required
    #: A prefill or decode engine needs a P/D `kv_connector` (simengine moves KV itself).
    pd_needs_connector: bool
    health_path: str  # answers 200 once the engine serves requests (readiness, then liveness)

    def check(self, engine: EngineConfig) -> str | None:
        """Why this backend cannot launch the engine's layout (one line, the caller names the engine), or None."""
        ...

    def program(self, engine: EngineConfig) -> list[str]:
        """The command that starts the engine, before the flags every backend gets."""
        ...

    def model_args(self, engine: EngineConfig) -> list[str]:
        """Flags that follow `--served-model-name`/`--block-size` about what is served (simengine's tokenizer)."""
        ...

    def parallel_args(self, engine: EngineConfig, layout: ProcessLayout) -> list[str]:
        """The parallelism flags of one process of the engine."""
        ...

    def devices_env(self, devices: Sequence[int]) -> dict[str, str]:
        """The environment that makes `devices` (this process's accelerator ids, in order) the visible ones."""
        ...

    def kv_host_env(self, engine: EngineConfig) -> dict[str, str]:
        """The environment that makes the engine's KV listener bind and announce its own `host` (not a `localhost`
        default, or a peer on another node would pull from, or push to, itself); empty when its connector takes
        the address elsewhere."""
        ...

    def read_load(self, metrics: str) -> EngineLoad:
        """The engine's load and progress counters from its `/metrics` text (the names are the backend's)."""
        ...

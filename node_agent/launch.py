"""Engine launch commands as argument lists and environments (never shell strings).

One `EngineConfig` becomes one or more processes on this node:
- external DP load balancing (vLLM-Ascend P/D deployments): one API server per local DP rank, each with
  `--data-parallel-rank`, its own HTTP port (`port + i`), its own devices, registered as its own instance;
- internal DP load balancing: one API server for the node's ranks (`--data-parallel-size-local`); a node whose
  first rank is not 0 runs `--headless` (no API server);
- a DP rank spanning nodes (`nnodes > 1`, multiprocessing backend): `--nnodes --node-rank --master-addr
  --master-port`; node rank > 0 is `--headless`.

This module decides the layout and the flags every engine gets; what differs per engine (program, model and
parallel flags, device variable) is its backend's (`node_agent.backends`).

Facts, each read from the sources named here (2026 snapshots):
- vLLM flags: vllm/engine/arg_utils.py (`--data-parallel-size/-rank/-start-rank/-size-local/-address/-rpc-port`,
  `--nnodes`, `--node-rank`, `--master-addr`, `--master-port`, `--prefill-context-parallel-size`,
  `--kv-transfer-config`, `--kv-events-config`), vllm/entrypoints/launchers/cli_args.py (`--headless`),
  vllm/entrypoints/cli/serve.py (`--data-parallel-rank` selects external LB, `--data-parallel-start-rank` hybrid LB;
  they cannot be combined). vLLM checks `world_size % nnodes == 0` and derives
  `local_world_size = world_size // nnodes` with `world_size = pp * tp * pcp` (arg_utils.py); we check it first.
- vLLM-Ascend external DP: examples/external_online_dp/run_dp_template.sh and launch_online_dp.py
  (`ASCEND_RT_VISIBLE_DEVICES` per rank = the rank's contiguous devices, `--port` = start port + local index,
  `--data-parallel-size/-rank/-address/-rpc-port`, `--tensor-parallel-size`).
- vLLM-Ascend cross-node PP: docs user_guide/feature_guide/pipeline_parallel.md (`--distributed-executor-backend mp
  --nnodes 2 --node-rank R --master-addr A --master-port P`, `--headless` on node rank 1; `VLLM_PP_LAYER_PARTITION`
  on the prefill process and `prefill.pp_layer_partition` in the connector's extra config).
- Mooncake `kv_transfer_config`: tutorials/features/pd_disaggregation_mooncake_multi_node.md (connector names
  `MooncakeConnectorV1` and `MooncakeLayerwiseConnector`, `kv_role`, `kv_port`, `kv_connector_extra_config`
  `prefill`/`decode` with `dp_size`/`tp_size`); vllm_ascend mooncake_connector.py asserts both sides' `dp_size` and
  `tp_size` and reads `pp_size` (default 1) and `prefill.pp_layer_partition`.
- `engine_id`: one per engine (the instance id) for every rank: vLLM appends `_dp<rank>` itself
  (vllm/v1/engine/core.py, "ensure that the kv_transfer_config is unique for each DP rank").
- `--data-parallel-rank` (external LB) is for MoE models; vLLM asks dense models to run independent engines
  (arg_utils.py help text): give a dense model one engine per rank with data_parallel_size 1.
- LoRA: vllm/engine/arg_utils.py (`--enable-lora`, `--max-loras`, `--max-lora-rank` one of 1, 8, 16, ..., 512,
  `--max-cpu-loras` >= `--max-loras`, default equal), vllm/entrypoints/serve/lora/api_router.py (the runtime
  load/unload routes exist only with `VLLM_ALLOW_RUNTIME_LORA_UPDATING` 1/true); vLLM-Ascend takes the same flags.
- KV events: vllm/distributed/kv_events.py: the publisher binds ipc endpoints and tcp endpoints with `*`; per DP rank
  `offset_endpoint_port` adds the rank to tcp ports and raises on ipc endpoints when the rank is not 0.
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from node_agent.backends import Backend, ProcessLayout, get_backend
from node_agent.config import MOONCAKE_TOPOLOGY_CONNECTORS, EngineConfig, lora_rank_for


class LaunchError(ValueError):
    """An engine cannot be launched as configured (one line naming the engine and the key)."""


@dataclass(frozen=True, slots=True)
class Placement:
    """Values injected at run time (agent flags or environment); they override placeholders in the config."""

    node_rank: int | None = None
    master_addr: str | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Placement:
        """`TANDEM_NODE_RANK` and `TANDEM_MASTER_ADDR` (set by a systemd EnvironmentFile, a pod spec, ...)."""
        env = os.environ if env is None else env
        rank = env.get("TANDEM_NODE_RANK", "").strip()
        if rank and not rank.isdigit():
            raise LaunchError(f"TANDEM_NODE_RANK must be a non-negative integer, not {rank!r}")
        return cls(int(rank) if rank else None, env.get("TANDEM_MASTER_ADDR", "").strip() or None)


@dataclass(frozen=True, slots=True)
class KvEventSource:
    """One DP rank's KV event sockets as the relay reaches them (the engine binds them)."""

    dp_rank: int
    endpoint: str
    replay_endpoint: str | None


@dataclass(frozen=True, slots=True)
class LaunchSpec:
    """What to execute for one engine process."""

    name: str  # unique on the node: the registered instance id, or `<instance_id>-node<rank>` when headless
    argv: list[str]
    events_instance: str = (
        ""  # the instance its KV events belong to (internal DP: the head node's API server)
    )
    env: dict[str, str] = field(default_factory=dict)  # added to the agent's own environment
    kv_events: tuple[KvEventSource, ...] = ()
    port: int | None = None  # HTTP port; None for a headless process (no API server, nothing to register)
    data_parallel_size: int = 1  # DP ranks behind this process's address (reported at registration)
    dp_ranks: tuple[int, ...] = (0,)  # the DP ranks this process runs

    @property
    def headless(self) -> bool:
        return self.port is None


def _json(value: object) -> str:
    return json.dumps(value, separators=(",", ":"))


def kv_transfer_config(engine: EngineConfig, runtime_dir: str) -> dict | None:
    """`--kv-transfer-config`: connector, `kv_role` from the role, `engine_id` from the instance id, merged extras
    (the engine's own `kv_transfer_config` keys win). The KV listener's address is not here: vLLM takes it from
    `VLLM_NIXL_SIDE_CHANNEL_HOST` (the backend's `kv_host_env`, set by `build_launch`), and its `KVTransferConfig`
    rejects keys it does not know (vLLM 0.32 has no `kv_ip`)."""
    if not engine.kv_connector:
        return None
    extra = copy.deepcopy(engine.kv_connector_extra_config)
    if engine.kv_connector in MOONCAKE_TOPOLOGY_CONNECTORS and engine.role in ("prefill", "decode"):
        # This engine's side is filled from its own sizes; the user's other fields (pp_layer_partition, ...) and
        # the peer side stay as written.
        own = dict(extra.get(engine.role) or {})
        own.update(dp_size=engine.data_parallel_size, tp_size=engine.tensor_parallel_size)
        if engine.pipeline_parallel_size > 1 or "pp_size" in own:
            own["pp_size"] = engine.pipeline_parallel_size
        extra[engine.role] = own
    if engine.kv_connector in ("ExampleConnector", "SharedStorageConnector"):
        # P and D must see one directory; on one node the agent's runtime dir is shared by both.
        extra.setdefault("shared_storage_path", os.path.join(runtime_dir, "kv-shared"))
    config: dict = {
        "kv_connector": engine.kv_connector,
        "kv_role": engine.kv_role,
        "engine_id": engine.instance_id,
    }
    if engine.kv_port is not None:
        config["kv_port"] = engine.kv_port
    config.update(engine.kv_transfer_config)
    config["kv_connector_extra_config"] = extra
    return config


#: The variable that makes vLLM (and simengine) serve `/v1/load_lora_adapter` and `/v1/unload_lora_adapter`.
RUNTIME_LORA_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


def lora_args(engine: EngineConfig) -> list[str]:
    """The LoRA flags of an engine that serves adapters (none otherwise). `--max-cpu-loras` keeps every configured
    adapter's weights in memory (vLLM's default, `--max-loras`, would read evicted ones again at their next step)."""
    if not engine.lora_enabled:
        return []
    slots = engine.lora_slots
    argv = [
        "--enable-lora",
        "--max-loras",
        str(slots),
        "--max-lora-rank",
        str(lora_rank_for(engine.adapters)),
    ]
    return argv + ["--max-cpu-loras", str(max(slots, len(engine.adapters)))]


def _kv_events(engine: EngineConfig, runtime_dir: str, name: str, ranks: tuple[int, ...]) -> tuple[str, list]:
    """The `--kv-events-config` JSON and the relay's view of each rank's sockets."""
    if engine.kv_events_port is None:
        # One rank 0 process: IPC sockets in the runtime dir, local to the node (no network address bound).
        base = os.path.join(runtime_dir, f"{name}-kv")
        pub, replay = f"ipc://{base}.sock", f"ipc://{base}-replay.sock"
        sources = [KvEventSource(r, pub, replay) for r in ranks]
    else:
        # vLLM binds `tcp://*:P` (`*` makes it bind; an explicit host makes it connect) and adds the DP rank.
        port, replay_port = engine.kv_events_port, engine.kv_events_port + engine.data_parallel_size
        pub, replay = f"tcp://*:{port}", f"tcp://*:{replay_port}"
        host = "127.0.0.1" if ":" not in engine.host else "[::1]"
        sources = [
            KvEventSource(r, f"tcp://{host}:{port + r}", f"tcp://{host}:{replay_port + r}") for r in ranks
        ]
    events = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": pub,
        "replay_endpoint": replay,
        "topic": "kv-events",
    }
    return _json(events), sources


def _devices_env(engine: EngineConfig, backend: Backend, index: int, count: int) -> dict[str, str]:
    """The devices of local process `index` that runs `count` DP ranks, in the backend's variable."""
    if engine.devices is None:
        return {}
    width = engine.local_world_size * count
    return backend.devices_env(engine.devices[index * width : (index + 1) * width])


def _placement(engine: EngineConfig, placement: Placement) -> tuple[int, str | None]:
    node_rank = placement.node_rank if placement.node_rank is not None else engine.node_rank
    master_addr = placement.master_addr or engine.master_addr
    me = f"engine {engine.instance_id!r}"
    if engine.nnodes > 1:
        if node_rank is None:
            raise LaunchError(
                f"{me}: node_rank is not set (nnodes {engine.nnodes}): pass --node-rank or TANDEM_NODE_RANK"
            )
        if node_rank >= engine.nnodes:
            raise LaunchError(f"{me}: node_rank {node_rank} must be below nnodes {engine.nnodes}")
        if master_addr is None:
            raise LaunchError(
                f"{me}: master_addr is not set (nnodes {engine.nnodes}): pass --master-addr or TANDEM_MASTER_ADDR"
            )
    return node_rank or 0, master_addr


def build_launch(
    engine: EngineConfig, runtime_dir: str, placement: Placement = Placement()
) -> list[LaunchSpec]:
    """The processes of an engine on this node, in local rank order."""
    backend = get_backend(engine.backend)
    node_rank, master_addr = _placement(engine, placement)
    problem = backend.check(engine)
    if problem is not None:
        raise LaunchError(f"engine {engine.instance_id!r}: {problem}")
    transfer = kv_transfer_config(engine, runtime_dir)
    start, local = engine.data_parallel_start_rank, engine.local_dp_size
    dp = engine.data_parallel_size
    groups: list[tuple[tuple[int, ...], int]]
    if engine.data_parallel_mode == "external" or dp == 1:
        groups = [((start + i,), i) for i in range(local)]
    else:
        groups = [(tuple(range(start, start + local)), 0)]
    specs = []
    for ranks, index in groups:
        external = dp > 1 and engine.data_parallel_mode == "external"
        headless = (engine.nnodes > 1 and node_rank > 0) or (not external and dp > 1 and start > 0)
        if headless:
            name = (
                f"{engine.instance_id}-node{node_rank}"
                if engine.nnodes > 1
                else f"{engine.instance_id}-dp{start}"
            )
        else:
            name = f"{engine.instance_id}-dp{ranks[0]}" if external else engine.instance_id
        port = None if headless else engine.port + index
        layout = ProcessLayout(ranks, external, headless, node_rank, master_addr)
        argv = backend.program(engine)
        if not headless:
            argv += ["--host", engine.host, "--port", str(port)]
        argv += ["--served-model-name", engine.model, "--block-size", str(engine.block_size)]
        argv += backend.model_args(engine)
        argv += backend.parallel_args(engine, layout)
        if transfer is not None:
            argv += ["--kv-transfer-config", _json(transfer)]
        sources: list[KvEventSource] = []
        # A headless node of a cross-node rank has no scheduler of its own: the head node publishes the events.
        if engine.kv_events and not (engine.nnodes > 1 and node_rank > 0):
            events, sources = _kv_events(engine, runtime_dir, name, ranks)
            argv += ["--kv-events-config", events]
        argv += lora_args(engine)
        argv += engine.args
        env = _devices_env(engine, backend, index, len(ranks))
        env.update(backend.kv_host_env(engine))
        if engine.lora_enabled:
            env[RUNTIME_LORA_ENV] = "True"
        partition = (engine.kv_connector_extra_config.get("prefill") or {}).get("pp_layer_partition")
        if partition and engine.role == "prefill" and engine.pipeline_parallel_size > 1:
            env["VLLM_PP_LAYER_PARTITION"] = str(partition)
        env.update(engine.env)
        specs.append(
            LaunchSpec(
                name=name,
                events_instance=name if external or not headless else engine.instance_id,
                argv=argv,
                env=env,
                kv_events=tuple(sources),
                port=port,
                data_parallel_size=1 if external else len(ranks),
                dp_ranks=ranks,
            )
        )
    return specs


def registered_instance_ids(engine: EngineConfig, placement: Placement = Placement()) -> list[str]:
    """The instance ids this engine registers from this node (external DP: one per local rank; none when headless);
    for `tandem up` and tests that wait for engines by id."""
    return [s.name for s in build_launch(engine, "/nonexistent", placement) if not s.headless]

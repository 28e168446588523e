"""Conversions between `tandem.v1` messages and the coordinator's dataclasses (edges only)."""

from __future__ import annotations

from google.protobuf.timestamp_pb2 import Timestamp

from coordinator.decision_log import Decision, components
from coordinator.instances import EngineLoad, Health, InstanceInfo, InstanceState
from tandem.netaddr import split_host_port
from tandem.v1 import admin_pb2, common_pb2

ROLE_NAMES = {
    common_pb2.ROLE_HYBRID: "hybrid",
    common_pb2.ROLE_PREFILL: "prefill",
    common_pb2.ROLE_DECODE: "decode",
}
ROLE_VALUES = {v: k for k, v in ROLE_NAMES.items()}
DISPATCH_NAMES = {
    common_pb2.DISPATCH_CAPABILITY_AGGREGATED: "aggregated",
    common_pb2.DISPATCH_CAPABILITY_HANDOFF: "handoff",
    common_pb2.DISPATCH_CAPABILITY_TRIGGER: "trigger",
}
DISPATCH_VALUES = {v: k for k, v in DISPATCH_NAMES.items()}
HEALTH_VALUES = {
    Health.STARTING: common_pb2.HEALTH_STARTING,
    Health.HEALTHY: common_pb2.HEALTH_HEALTHY,
    Health.UNHEALTHY: common_pb2.HEALTH_UNHEALTHY,
}
HEALTH_NAMES = {v: k for k, v in HEALTH_VALUES.items()}


def _timestamp(seconds: float) -> Timestamp:
    ts = Timestamp()
    ts.FromNanoseconds(int(seconds * 1e9))
    return ts


def instance_from_proto(msg: common_pb2.Instance) -> InstanceInfo:
    """An `Instance` message as a dataclass; ValueError naming the bad field."""
    if not msg.instance_id:
        raise ValueError("instance.instance_id is required")
    if not msg.model:
        raise ValueError("instance.model is required")
    if not msg.address:
        raise ValueError("instance.address is required")
    try:
        split_host_port(msg.address)
    except ValueError as exc:
        raise ValueError(f"instance.address: {exc}") from None
    if msg.role not in ROLE_NAMES:
        raise ValueError("instance.role must be set (ROLE_HYBRID, ROLE_PREFILL or ROLE_DECODE)")
    if msg.dispatch_capability not in DISPATCH_NAMES:
        raise ValueError("instance.dispatch_capability must be set")
    return InstanceInfo(
        instance_id=msg.instance_id,
        model=msg.model,
        address=msg.address,
        role=ROLE_NAMES[msg.role],
        dispatch=DISPATCH_NAMES[msg.dispatch_capability],
        node_id=msg.node_id,
        backend=msg.backend,
        block_size=msg.block_size or 16,
        data_parallel_size=msg.data_parallel_size or 1,
        kv_connector=msg.kv_connector,
    )


def instance_to_proto(info: InstanceInfo) -> common_pb2.Instance:
    """The dataclass as an `Instance` message."""
    return common_pb2.Instance(
        instance_id=info.instance_id,
        model=info.model,
        address=info.address,
        role=ROLE_VALUES[info.role],
        dispatch_capability=DISPATCH_VALUES[info.dispatch],
        node_id=info.node_id,
        backend=info.backend,
        block_size=info.block_size,
        data_parallel_size=info.data_parallel_size,
        kv_connector=info.kv_connector,
    )


def load_from_proto(msg: common_pb2.InstanceLoad) -> EngineLoad:
    """An `InstanceLoad` message as a dataclass."""
    sampled = msg.sampled_at.ToNanoseconds() / 1e9 if msg.HasField("sampled_at") else 0.0
    progress = {p.dp_rank: (p.prompt_tokens_total, p.generation_tokens_total) for p in msg.progress}
    load = EngineLoad(msg.running_requests, msg.waiting_requests, msg.kv_cache_usage, sampled, progress)
    load.prefix_hits = {p.dp_rank: p.prefix_cache_hits_total for p in msg.progress}
    load.adapters = frozenset(msg.loaded_adapters)  # LoRA adapters the engine serves, and its slots
    load.max_loras = msg.max_loras
    load.kv_transfers, load.kv_transfer_failures = msg.kv_transfers_total, msg.kv_transfer_failures_total
    load.kv_blocks = msg.kv_blocks
    return load


def status_to_proto(state: InstanceState, ledger) -> admin_pb2.InstanceStatus:
    """What Admin shows about one instance."""
    load = state.load
    iid = state.info.instance_id
    return admin_pb2.InstanceStatus(
        instance=instance_to_proto(state.info),
        # Until it answers the coordinator's health probe an instance is starting, whatever its agent says.
        health=HEALTH_VALUES[state.health if state.verified else Health.STARTING],
        load=common_pb2.InstanceLoad(
            running_requests=load.running,
            waiting_requests=load.waiting,
            kv_cache_usage=load.kv_cache_usage,
            sampled_at=_timestamp(load.sampled_at) if load.sampled_at else None,
            progress=[
                common_pb2.RankProgress(
                    dp_rank=rank,
                    prompt_tokens_total=prompt,
                    generation_tokens_total=generation,
                    prefix_cache_hits_total=load.prefix_hits.get(rank, 0),
                )
                for rank, (prompt, generation) in sorted(load.progress.items())
            ],
            loaded_adapters=sorted(load.adapters),  # the LoRA adapters it serves, as its heartbeat says
            max_loras=load.max_loras,
            kv_transfer_failures_total=load.kv_transfer_failures,
            kv_transfers_total=load.kv_transfers,
            kv_blocks=load.kv_blocks,
        ),
        drained=state.drained,
        workload_tokens=ledger.tokens(iid),
        inflight_requests=ledger.requests(iid),
        prefill_tokens=ledger.prefill_tokens(iid),
        decode_tokens=ledger.decode_tokens(iid),
        registered_at=_timestamp(state.registered_at),
        last_heartbeat_at=_timestamp(state.last_heartbeat_at),
    )


def decision_to_proto(d: Decision) -> admin_pb2.Decision:
    """One kept decision as Admin lists it: its candidates' score components computed now (`decision_log`)."""
    out = admin_pb2.Decision(
        request_id=d.request_id,
        model=d.model,
        policy=d.policy,
        stage=d.stage,
        chosen=d.chosen,
        prompt_tokens=d.isl,
        predicted_ttft_seconds=d.predicted_ttft_s or 0.0,
    )
    out.decided_at.FromNanoseconds(int(d.at * 1e9))
    for c in d.candidates:
        iid = c.instance_id
        k = components(c, d.isl)
        out.candidates.append(
            admin_pb2.CandidateScore(
                instance_id=iid,
                matched_npu_tokens=k.matched_npu_tokens,
                matched_cpu_tokens=k.matched_cpu_tokens,
                matched_disk_tokens=k.matched_disk_tokens,
                prefill_tokens=k.prefill_tokens,
                decode_tokens=k.decode_tokens,
                inflight=k.inflight,
                predicted_ttft_seconds=k.predicted_ttft_s,
                chosen=iid in d.chosen,
            )
        )
    return out

"""Fake candidates for table-driven policy tests (no server needed)."""

from __future__ import annotations

from coordinator.instances import EngineLoad, InstanceInfo, InstanceState
from coordinator.scheduling import Candidate, KvMatch, RequestFacts


def facts(isl: int = 160, max_tokens: int = 16, model: str = "m") -> RequestFacts:
    return RequestFacts("r", model, isl, max_tokens)


def cand(
    iid: str,
    prefill: int = 0,
    decode: int = 0,
    inflight: int = 0,
    context: int = 0,
    npu: int = 0,
    cpu: int = 0,
    disk: int = 0,
    block_size: int = 16,
    running: int = 0,
    waiting: int = 0,
    kv_usage: float = 0.0,
    role: str = "hybrid",
    node: str = "",
) -> Candidate:
    dispatch = "aggregated" if role == "hybrid" else "handoff"
    info = InstanceInfo(
        iid, "m", f"127.0.0.1:{8000 + len(iid)}", role, dispatch, node_id=node, block_size=block_size
    )
    state = InstanceState(info=info, load=EngineLoad(running, waiting, kv_usage))
    return Candidate(state, prefill, decode, inflight, context, KvMatch(npu, cpu, disk, block_size))

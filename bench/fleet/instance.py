"""One simulated engine in virtual time: simengine's scheduler, KV cache manager and timing profile, stepped by
the fleet's event loop instead of asyncio sleeps; its KV events go straight into the conductor's index."""

from __future__ import annotations

from dataclasses import dataclass

from conductor.index import KvIndex
from coordinator.instances import EngineLoad, InstanceInfo, InstanceState
from simengine import events as sim_events
from simengine.events import EventSink
from simengine.kv_cache_manager import KVCacheManager
from simengine.profiles import PROFILES
from simengine.request import Request
from simengine.sampler import Sampler
from simengine.scheduler import Scheduler, SchedulerOutput
from tandem import kv_events


@dataclass(frozen=True, slots=True)
class EngineSpec:
    """The simengine options that matter to timing and caching (same names and defaults as its CLI)."""

    profile: str = "ascend-910b"  # timing profile
    npu_blocks: int = 2048  # KV blocks on the accelerator
    cpu_blocks: int = 0  # KV blocks in host memory (offload on when > 0)
    block_size: int = 16  # tokens per block
    max_num_seqs: int = 256  # sequences per step
    max_num_batched_tokens: int = 8192  # token budget per step

    @property
    def max_model_len(self) -> int:
        """As simengine: at most 32768 and at most what the NPU pool holds."""
        return min(32768, self.npu_blocks * self.block_size)


def _convert(event) -> kv_events.KvEvent:
    """simengine's event dataclasses -> the conductor's decoded form (what ingest produces from the wire)."""
    if type(event) is sim_events.BlockStored:
        return kv_events.BlockStored(
            event.block_hashes,
            event.parent_block_hash,
            event.token_ids,
            event.block_size,
            kv_events.normalize_medium(event.medium),
        )
    if type(event) is sim_events.BlockRemoved:
        return kv_events.BlockRemoved(event.block_hashes, kv_events.normalize_medium(event.medium))
    return kv_events.AllBlocksCleared()


class SimInstance:
    """Engine state plus the coordinator's view of it (`state`, refreshed by `report_load`)."""

    def __init__(
        self, instance_id: str, model: str, spec: EngineSpec, sampler: Sampler, index: KvIndex | None
    ) -> None:
        self.spec = spec
        self.profile = PROFILES[spec.profile]
        self.sink = EventSink(enabled=index is not None)
        self.kv = KVCacheManager(
            num_npu_blocks=spec.npu_blocks,
            block_size=spec.block_size,
            sink=self.sink,
            num_cpu_blocks=spec.cpu_blocks,
            offload=spec.cpu_blocks > 0,
        )
        self.scheduler = Scheduler(self.kv, sampler, spec.max_num_seqs, spec.max_num_batched_tokens)
        info = InstanceInfo(
            instance_id, model, f"sim/{instance_id}", "hybrid", "aggregated", block_size=spec.block_size
        )
        self.state = InstanceState(info, registered_at=0.0, last_heartbeat_at=0.0)
        self.index = index
        self.holder = index.holder(instance_id, 0, model, spec.block_size) if index is not None else None
        self.busy = False  # a step is in progress (its end is in the event queue)
        self._out: SchedulerOutput | None = None
        self.steps = 0

    def add(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def start_step(self) -> float | None:
        """Schedules the next step; returns its duration (simulated seconds), None when there is nothing to do."""
        sched = self.scheduler
        if not sched.has_work:
            self.busy = False
            return None
        out = sched.schedule()
        if out.is_empty:
            self.busy = False
            return None
        self._out = out
        self.busy = True
        return self.profile.step_s(
            out.prefill_chunks, out.num_decode, out.decode_context, out.load_tokens_cpu, out.load_tokens_disk
        )

    def end_step(self) -> list[Request]:
        """Applies the step: requests with a new token (finished ones included); publishes its KV events."""
        out, self._out = self._out, None
        produced = self.scheduler.update(out)
        self.steps += 1
        if self.sink.events:
            index, holder = self.index, self.holder
            for event in self.sink.drain():
                index.apply(holder, _convert(event))
        return produced

    def report_load(self, now: float) -> None:
        """What the node agent's heartbeat carries: running, waiting, KV usage."""
        sched = self.scheduler
        self.state.load = EngineLoad(
            running=len(sched.running),
            waiting=len(sched.waiting) + len(sched.remote_waiting),
            kv_cache_usage=self.kv.usage(),
            sampled_at=now,
        )

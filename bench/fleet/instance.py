"""One simulated engine in virtual time: simengine's scheduler, KV cache manager and timing profile, stepped by
the fleet's event loop instead of asyncio sleeps; its KV events go straight into the conductor's index."""

from __future__ import annotations

from dataclasses import dataclass

from conductor.index import KvIndex
from coordinator.instances import EngineLoad, InstanceInfo, InstanceState
from simengine import events as sim_events
from simengine.block_hash import BlockHasher
from simengine.block_pool import BlockPool, KVBlock
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


class RememberingHasher(BlockHasher):
    """simengine's block hashes (vLLM's chain of sha256 digests), remembered across the simulations one process
    runs, up to `limit` blocks (then forgotten at once): every row of a routing cell, and every cache size and load
    of a workload, replays the same prompts, and hashing them took a quarter of a run. A block's digest is a pure
    function of what is remembered, so no figure changes."""

    __slots__ = ("_memo", "limit")

    def __init__(self, limit: int = 1_000_000) -> None:
        super().__init__()
        self._memo: dict[tuple, bytes] = {}
        self.limit = limit

    def hash_block(self, parent, token_ids, extra_keys=None) -> bytes:
        key = (parent, tuple(token_ids), extra_keys)
        digest = self._memo.get(key)
        if digest is None:
            if len(self._memo) >= self.limit:
                self._memo.clear()
            digest = self._memo[key] = super().hash_block(parent, key[1], extra_keys)
        return digest


#: The one hasher of every simulated engine in this process.
_HASHER = RememberingHasher()


class SimInstance:
    """Engine state plus the coordinator's view of it (`state`, refreshed by `report_load`)."""

    def __init__(
        self, instance_id: str, model: str, spec: EngineSpec, sampler: Sampler, index: KvIndex | None
    ) -> None:
        self.spec = spec
        self.profile = PROFILES[spec.profile]
        self.sink = EventSink(enabled=index is not None)
        self.kv = KVCacheManager(
            num_npu_blocks=1,  # replaced below by a lazily made pool of spec.npu_blocks
            block_size=spec.block_size,
            sink=self.sink,
            num_cpu_blocks=spec.cpu_blocks,
            offload=spec.cpu_blocks > 0,
            hasher=_HASHER,
        )
        pool = self.kv.pool
        self.kv.pool = LazyBlockPool(spec.npu_blocks, spec.block_size, self.sink)
        self.kv.pool.on_evict = pool.on_evict
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
        # vLLM's progress counters, as the node agent relays them: `vllm:prompt_tokens_total` grows by a request's
        # prompt length at its first token, `vllm:generation_tokens_total` by every token (the fleet updates them).
        self.prompt_counter = 0
        self.generation_counter = 0
        self.dead = False  # the engine process died (its pending step ends are ignored)
        self.speed = 1.0  # relative to the profile (a mixed fleet's slower accelerator: below 1)

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
        step = self.profile.step_s(
            out.prefill_chunks, out.num_decode, out.decode_context, out.load_tokens_cpu, out.load_tokens_disk
        )
        return step / self.speed

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


class LazyBlockPool(BlockPool):
    """simengine's `BlockPool` with its blocks made on first use instead of all at start (8M objects for 512
    instances of 16k blocks). Same allocation order: vLLM's free queue starts with every block in id order, freed
    blocks without cached content go to its head and cached ones to its tail, so the order is: freed uncached
    blocks, never-used blocks, freed cached blocks (LRU)."""

    def __init__(
        self, num_blocks: int, block_size: int, sink: EventSink, enable_caching: bool = True
    ) -> None:
        super().__init__(1, block_size, sink, enable_caching)
        self.num_blocks = num_blocks
        self.blocks = []
        self._free.clear()
        self._fresh = num_blocks  # blocks not made yet (at the head of the free queue)
        self.evictions = 0  # cached blocks whose content was dropped to make room

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            self.evictions += 1
        super()._evict(block)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free) + self._fresh

    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_new_blocks(self, n: int) -> list[KVBlock]:
        if n > self.num_free_blocks:
            raise ValueError(f"cannot get {n} free blocks from the pool ({self.num_free_blocks} free)")
        out = []
        while len(out) < n and self._free:  # freed uncached blocks sit ahead of the never-used ones
            head = next(iter(self._free.values()))
            if head.block_hash is not None:
                break
            out += super().get_new_blocks(1)
        n -= len(out)
        fresh = min(n, self._fresh)
        for _ in range(fresh):
            block = KVBlock(len(self.blocks), ref_cnt=1)
            self.blocks.append(block)
            out.append(block)
        self._fresh -= fresh
        if n > fresh:
            out += super().get_new_blocks(n - fresh)
        return out

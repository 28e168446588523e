"""KV cache manager: prefix matching over the tiers and slot allocation for requests, on top of the block pool
(vLLM v1's `KVCacheManager`). Pure: no I/O, no clock."""

from __future__ import annotations

from dataclasses import dataclass

from simengine.block_hash import BlockHasher, to_event_hash
from simengine.block_pool import BlockPool, KVBlock
from simengine.events import MEDIUM_CPU, MEDIUM_STORAGE, EventSink
from simengine.request import BlockHash, Request
from simengine.tiers import TierCache


def block_extra_keys(request: Request, block_index: int) -> tuple | None:
    """vLLM's per-block extra hash keys, in its order: the adapter's `("lora", name, path)` on every block of a
    LoRA request, then the cache salt on the first block (no multimodal here)."""
    keys: list[tuple] = []
    if request.lora is not None:
        keys.append(("lora", request.lora.name, request.lora.path))
    if block_index == 0 and request.cache_salt:
        keys.append(("cache_salt", request.cache_salt))
    return tuple(keys) if keys else None


def event_extra_keys(request: Request, block_index: int) -> tuple | None:
    """The same keys untagged, as vLLM's events carry them (`to_event_extra_keys`): the adapter's bare name and
    the bare salt."""
    keys = block_extra_keys(request, block_index)
    return None if keys is None else tuple(key[1] for key in keys)


@dataclass(slots=True)
class ComputedBlocks:
    """The prefix cache hit of a request at first scheduling (vLLM's `KVCacheBlocks`, with tier counts)."""

    #: NPU blocks holding the leading blocks of the prompt.
    npu_blocks: list[KVBlock]
    #: Blocks after those, found in the CPU tier, then the disk tier (to load before computing).
    num_cpu: int
    num_disk: int

    @property
    def num_blocks(self) -> int:
        return len(self.npu_blocks) + self.num_cpu + self.num_disk


class KVCacheManager:
    """Allocates NPU blocks to requests and keeps their chain hashes; finds prefix hits in NPU, CPU and disk."""

    def __init__(
        self,
        num_npu_blocks: int,
        block_size: int,
        sink: EventSink,
        enable_caching: bool = True,
        num_cpu_blocks: int = 0,
        num_disk_blocks: int = 0,
        offload: bool = False,
        hasher: BlockHasher | None = None,
    ) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        #: vLLM's default algorithm (sha256, fixed seed unless PYTHONHASHSEED) unless the engine says otherwise.
        self.hasher = hasher or BlockHasher()
        self.sink = sink
        self.pool = BlockPool(num_npu_blocks, block_size, sink, enable_caching)
        self.cpu = TierCache(MEDIUM_CPU, num_cpu_blocks, block_size, sink)
        self.disk = TierCache(MEDIUM_STORAGE, num_disk_blocks, block_size, sink)
        if num_disk_blocks > 0:
            self.cpu.next_tier = self.disk
        if offload and enable_caching:
            self.pool.on_evict = self._offload if num_cpu_blocks > 0 else self._offload_disk
        #: Prefix cache statistics in tokens, as vLLM's prefix_cache_queries / hits (`record_prefix_cache_stats`).
        self.queries = 0
        self.hits = 0

    def _offload(self, block: KVBlock) -> None:
        assert block.block_hash is not None  # only cached blocks are evicted to a lower tier
        self.cpu.put(block.block_hash, block.parent_hash, block.token_ids or [])

    def _offload_disk(self, block: KVBlock) -> None:
        assert block.block_hash is not None  # only cached blocks are evicted to a lower tier
        self.disk.put(block.block_hash, block.parent_hash, block.token_ids or [])

    def usage(self) -> float:
        return self.pool.usage()

    # -- hashing ----------------------------------------------------------------------------------------------

    def update_hashes(self, request: Request) -> None:
        """Extends the request's chain hashes over its full blocks (prompt and output)."""
        bs = self.block_size
        hashes = request.block_hashes
        digests = request.block_digests
        full = request.num_tokens // bs
        hash_block = self.hasher.hash_block
        while len(hashes) < full:
            i = len(hashes)
            parent = digests[-1] if digests else None
            digest = hash_block(
                parent, request.token_slice(i * bs, (i + 1) * bs), block_extra_keys(request, i)
            )
            digests.append(digest)
            hashes.append(BlockHash(to_event_hash(digest)))

    # -- matching ---------------------------------------------------------------------------------------------

    def get_computed_blocks(self, request: Request) -> ComputedBlocks:
        """Longest cached prefix of the request, block by block: NPU, else CPU, else disk; stops at a miss.
        At least one token is always left to compute (its logits give the first output token)."""
        self.update_hashes(request)
        if not self.enable_caching:
            return ComputedBlocks([], 0, 0)
        max_blocks = (request.num_tokens - 1) // self.block_size
        npu: list[KVBlock] = []
        num_cpu = num_disk = 0
        for h in request.block_hashes[:max_blocks]:
            if not num_cpu and not num_disk:  # NPU hits form a prefix; lower tiers continue it
                block = self.pool.get_cached_block(h)
                if block is not None:
                    npu.append(block)
                    continue
            if h in self.cpu:
                self.cpu.touch(h)
                num_cpu += 1
            elif h in self.disk:
                self.disk.touch(h)
                num_disk += 1
            else:
                break
        return ComputedBlocks(npu, num_cpu, num_disk)

    def record_prefix_cache_stats(self, request: Request, hit_tokens: int) -> None:
        """Counts a request's prefix lookup in `queries` / `hits` once, when the scheduler admits it, as vLLM 0.32
        does (`Scheduler.schedule`: "Record at admission so unscheduled lookups are not counted", vLLM PR 48860):
        a lookup whose request then waits for free blocks is not counted, nor its retries. A request preempted
        before goes to vLLM's separate preempted counters, which no metric exports: not counted here."""
        if self.enable_caching and request.num_preemptions == 0:
            self.queries += request.num_tokens
            self.hits += hit_tokens

    # -- allocation -------------------------------------------------------------------------------------------

    def num_blocks_needed(
        self, request: Request, num_new_tokens: int, computed: ComputedBlocks | None
    ) -> int:
        total = request.num_computed_tokens + num_new_tokens
        if computed is not None:
            total = max(total, computed.num_blocks * self.block_size + num_new_tokens)
        need = -(-total // self.block_size) - len(request.block_ids)
        if computed is not None:
            need -= len(computed.npu_blocks)
        return max(need, 0)

    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed: ComputedBlocks | None = None
    ) -> bool:
        """Gives the request blocks for `num_new_tokens` more tokens (after the computed prefix, for a newly
        scheduled request). Returns False, changing nothing, when the pool cannot provide them."""
        need = self.num_blocks_needed(request, num_new_tokens, computed)
        # Touching cached-but-free blocks takes them out of the free queue too.
        reuse = [b for b in computed.npu_blocks if b.ref_cnt == 0] if computed is not None else []
        if need + len(reuse) > self.pool.num_free_blocks:
            return False
        if computed is not None:
            self.pool.touch(computed.npu_blocks)
            request.block_ids.extend(b.block_id for b in computed.npu_blocks)
            request.num_computed_tokens = len(computed.npu_blocks) * self.block_size
            request.num_cached_blocks = len(computed.npu_blocks)
            request.load_tokens_cpu = computed.num_cpu * self.block_size
            request.load_tokens_disk = computed.num_disk * self.block_size
        if need:
            request.block_ids.extend(b.block_id for b in self.pool.get_new_blocks(need))
        return True

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Caches the request's blocks that became full with `num_computed_tokens` computed."""
        if not self.enable_caching:
            return
        self.update_hashes(request)
        bs = self.block_size
        full = min(num_computed_tokens // bs, len(request.block_hashes), len(request.block_ids))
        start = request.num_cached_blocks
        if full <= start:
            return
        blocks = self.pool.blocks
        new = [blocks[i] for i in request.block_ids[start:full]]
        parent = request.block_hashes[start - 1] if start else None
        extra = [event_extra_keys(request, i) for i in range(start, full)]
        lora = request.lora
        self.pool.cache_full_blocks(
            new, request.block_hashes[start:full], parent, request.token_slice(start * bs, full * bs), extra,
            lora.int_id if lora is not None else None, lora.name if lora is not None else None,
        )  # fmt: skip
        request.num_cached_blocks = full

    def free(self, request: Request) -> None:
        """Returns the request's blocks, tail first, so the prefix stays cached longest."""
        blocks = self.pool.blocks
        self.pool.free_blocks([blocks[i] for i in reversed(request.block_ids)])
        request.block_ids = []
        request.num_cached_blocks = 0

    def reset(self) -> None:
        """Drops every cached block of every tier; one `AllBlocksCleared`."""
        self.pool.reset_prefix_cache()
        self.cpu.clear()
        self.disk.clear()

"""NPU block pool: mechanism only (allocate, free, cache, evict, touch), as vLLM v1's `BlockPool`.

Freed blocks keep their content and stay findable by hash until a new allocation takes them (LRU order):
that is the prefix cache. Taking a cached block out of the pool evicts it, which emits `BlockRemoved` and, when
offloading is on, hands the block to the next tier. As in vLLM, two blocks may hold the same content (two
sequences that computed the same prefix in one step): both are cached under the hash, each is announced by
its own `BlockStored` and each eviction sends its own `BlockRemoved`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from simengine.events import MEDIUM_GPU, SPEC_FULL_ATTENTION, EventSink
from simengine.request import BlockHash


@dataclass(slots=True)
class KVBlock:
    """One NPU block."""

    block_id: int
    #: Requests using the block; 0 means it sits in the free queue (evictable if cached).
    ref_cnt: int = 0
    #: Chain hash once the block is full and cached; None for a partial or uncached block.
    block_hash: BlockHash | None = None
    #: Hash of the block before it in its chain (for events and offload).
    parent_hash: BlockHash | None = None
    #: The block's tokens once full (for offload events).
    token_ids: list[int] | None = None


#: Called with an evicted block (before its content is dropped), e.g. to offload it to the CPU tier.
EvictHook = Callable[[KVBlock], None]


class BlockPool:
    """`num_blocks` NPU blocks. The free queue is an OrderedDict keyed by block id: O(1) removal from the middle
    (a cached block being reused) and O(1) pop of the least recently freed block, both in C."""

    def __init__(
        self, num_blocks: int, block_size: int, sink: EventSink, enable_caching: bool = True
    ) -> None:
        if num_blocks < 1:
            raise ValueError("the NPU pool needs at least one block")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        #: hash -> the blocks holding that content, by block id (first cached first: that one serves hits).
        self.cached: dict[BlockHash, dict[int, KVBlock]] = {}
        self.sink = sink
        self.on_evict: EvictHook | None = None

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def usage(self) -> float:
        """Share of blocks in use by requests (cached-but-free blocks count as free), 0..1, as vLLM reports."""
        return 1.0 - len(self._free) / self.num_blocks

    def get_cached_block(self, block_hash: BlockHash) -> KVBlock | None:
        holders = self.cached.get(block_hash)
        return next(iter(holders.values())) if holders else None

    def touch(self, blocks: list[KVBlock]) -> None:
        """Takes a reference on cached blocks a new request reuses; pulls them out of the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def get_new_blocks(self, n: int) -> list[KVBlock]:
        """Takes `n` blocks from the head of the free queue, evicting their cached content."""
        if n > len(self._free):
            raise ValueError(f"cannot get {n} free blocks from the pool ({len(self._free)} free)")
        out = []
        for _ in range(n):
            _, block = self._free.popitem(last=False)
            if block.block_hash is not None:
                self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def _evict(self, block: KVBlock) -> None:
        h = block.block_hash
        if h is None:  # never cached: nothing to drop or announce
            return
        holders = self.cached.get(h)
        if holders is not None and holders.pop(block.block_id, None) is block:
            if not holders:
                del self.cached[h]
            self.sink.removed(h, MEDIUM_GPU, 0)
            if self.on_evict is not None and not holders:
                self.on_evict(block)
        block.block_hash = None
        block.parent_hash = None
        block.token_ids = None

    def cache_full_blocks(
        self,
        blocks: list[KVBlock],
        hashes: list[BlockHash],
        parent: BlockHash | None,
        tokens: list[int],
        extra_keys: list[tuple | None] | None = None,
        lora_id: int | None = None,
        lora_name: str | None = None,
    ) -> None:
        """Marks newly full blocks as cached under their chain hashes; one `BlockStored` for them all, as
        vLLM's `cache_full_blocks` (content another block already holds is cached and announced again)."""
        if not self.enable_caching or not blocks:
            return
        bs = self.block_size
        prev = parent
        for i, (block, h) in enumerate(zip(blocks, hashes, strict=True)):
            block.block_hash = h
            block.parent_hash = prev
            block.token_ids = tokens[i * bs : (i + 1) * bs]
            self.cached.setdefault(h, {})[block.block_id] = block
            prev = h
        self.sink.stored(
            list(hashes),
            parent,
            tokens,
            bs,
            MEDIUM_GPU,
            extra_keys or [None] * len(hashes),
            0,
            SPEC_FULL_ATTENTION,
            lora_id,
            lora_name,
        )

    def free_blocks(self, blocks: list[KVBlock]) -> None:
        """Drops one reference per block. As vLLM 0.32, blocks reaching 0 without cached content go to the head
        of the free queue in the order given (reused first, LIFO), cached ones to its tail (evicted last, LRU);
        callers pass a request's blocks tail first, so its prefix is evicted last."""
        first: list[KVBlock] = []
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None or not self.enable_caching:
                    first.append(block)
                else:
                    self._free[block.block_id] = block
        for block in reversed(first):
            self._free[block.block_id] = block
            self._free.move_to_end(block.block_id, last=False)

    def reset_prefix_cache(self) -> None:
        """Forgets every cached hash (blocks in use keep their data but are no longer shared)."""
        for block in self.blocks:
            block.block_hash = None
            block.parent_hash = None
            block.token_ids = None
        self.cached.clear()
        self.sink.cleared()

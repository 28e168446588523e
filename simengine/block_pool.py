"""NPU block pool: mechanism only (allocate, free, cache, evict, touch), as vLLM v1's `BlockPool`.

Freed blocks keep their content and stay findable by hash until a new allocation takes them (LRU order):
that is the prefix cache. Taking a cached block out of the pool evicts it, which emits `BlockRemoved` and, when
offloading is on, hands the block to the next tier.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from simengine.events import MEDIUM_GPU, EventSink
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
        self.cached: dict[BlockHash, KVBlock] = {}
        self.sink = sink
        self.on_evict: EvictHook | None = None

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def usage(self) -> float:
        """Share of blocks in use by requests (cached-but-free blocks count as free), 0..1, as vLLM reports."""
        return 1.0 - len(self._free) / self.num_blocks

    def get_cached_block(self, block_hash: BlockHash) -> KVBlock | None:
        return self.cached.get(block_hash)

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
        if self.cached.get(h) is block:
            del self.cached[h]
            self.sink.removed(h, MEDIUM_GPU)
            if self.on_evict is not None:
                self.on_evict(block)
        block.block_hash = None
        block.parent_hash = None
        block.token_ids = None

    def cache_full_blocks(
        self, blocks: list[KVBlock], hashes: list[BlockHash], parent: BlockHash | None, tokens: list[int]
    ) -> None:
        """Marks newly full blocks as cached under their chain hashes; emits one `BlockStored` for them all."""
        if not self.enable_caching or not blocks:
            return
        bs = self.block_size
        run: list[BlockHash] = []  # a contiguous run of newly cached blocks, published as one event
        run_start = 0
        prev = parent
        for i, (block, h) in enumerate(zip(blocks, hashes, strict=True)):
            if h in self.cached:  # the same content is cached in another block already: keep that one
                self._flush(run, run_start, parent, hashes, tokens)
                run, run_start, prev = [], i + 1, h
                continue
            block.block_hash = h
            block.parent_hash = prev
            block.token_ids = tokens[i * bs : (i + 1) * bs]
            self.cached[h] = block
            run.append(h)
            prev = h
        self._flush(run, run_start, parent, hashes, tokens)

    def _flush(
        self,
        run: list[BlockHash],
        start: int,
        parent: BlockHash | None,
        hashes: list[BlockHash],
        tokens: list[int],
    ) -> None:
        if run:
            bs = self.block_size
            parent_of_first = parent if start == 0 else hashes[start - 1]
            self.sink.stored(
                run, parent_of_first, tokens[start * bs : (start + len(run)) * bs], bs, MEDIUM_GPU
            )

    def free_blocks(self, blocks: list[KVBlock]) -> None:
        """Drops one reference per block; blocks reaching 0 go to the tail of the free queue, in the order given
        (callers pass a request's blocks tail first, so its prefix is evicted last)."""
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = block

    def reset_prefix_cache(self) -> None:
        """Forgets every cached hash (blocks in use keep their data but are no longer shared)."""
        for block in self.blocks:
            block.block_hash = None
            block.parent_hash = None
            block.token_ids = None
        self.cached.clear()
        self.sink.cleared()

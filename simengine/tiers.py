"""Lower KV tiers (host memory "CPU", disk "STORAGE"): LRU maps from block hash to the block's facts.

They hold no data, only what the events and the timing model need. A block evicted from the NPU is offloaded to
the CPU tier when offloading is on; a block evicted from the CPU tier goes to disk when disk blocks exist.
"""

from __future__ import annotations

from collections import OrderedDict

from simengine.events import EventSink
from simengine.request import BlockHash


class TierCache:
    """`capacity` blocks of one medium with LRU eviction to an optional next tier."""

    def __init__(self, medium: str, capacity: int, block_size: int, sink: EventSink) -> None:
        self.medium = medium
        self.capacity = capacity
        self.block_size = block_size
        self.sink = sink
        #: hash -> (parent hash, tokens); least recently used first.
        self.entries: OrderedDict[BlockHash, tuple[BlockHash | None, list[int]]] = OrderedDict()
        self.next_tier: TierCache | None = None

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self.entries

    def __len__(self) -> int:
        return len(self.entries)

    def touch(self, block_hash: BlockHash) -> None:
        self.entries.move_to_end(block_hash)

    def put(self, block_hash: BlockHash, parent: BlockHash | None, tokens: list[int]) -> None:
        """Stores one block (emits `BlockStored` for this medium), evicting the least recently used if full."""
        if self.capacity <= 0:
            return
        if block_hash in self.entries:
            self.entries.move_to_end(block_hash)
            return
        while len(self.entries) >= self.capacity:
            old_hash, (old_parent, old_tokens) = self.entries.popitem(last=False)
            self.sink.removed(old_hash, self.medium)
            if self.next_tier is not None:
                self.next_tier.put(old_hash, old_parent, old_tokens)
        self.entries[block_hash] = (parent, tokens)
        self.sink.stored([block_hash], parent, list(tokens), self.block_size, self.medium)

    def clear(self) -> None:
        self.entries.clear()

"""KV cache events as plain data, emitted where cache state changes (block pool, tiers) and published elsewhere.

Field names follow vLLM's `vllm/distributed/kv_events.py`; media are the strings vLLM publishes:
"GPU" for device memory (vLLM-Ascend reports its NPU blocks as "GPU" too), "CPU", "STORAGE".
"""

from __future__ import annotations

from dataclasses import dataclass

from simengine.request import BlockHash

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
MEDIUM_STORAGE = "STORAGE"


@dataclass(slots=True)
class BlockStored:
    """Full blocks that entered a medium; `parent_block_hash` chains the first one to the prefix before it."""

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    #: Tokens of all the blocks, in order (len = block_size * len(block_hashes)).
    token_ids: list[int]
    block_size: int
    medium: str


@dataclass(slots=True)
class BlockRemoved:
    """Blocks that left a medium."""

    block_hashes: list[BlockHash]
    medium: str


@dataclass(slots=True)
class AllBlocksCleared:
    """Every block of every medium is gone (sent once at start, as a reset marker)."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class EventSink:
    """Collects events between two publish points; merges consecutive removals of one medium."""

    __slots__ = ("events", "enabled")

    def __init__(self, enabled: bool = True) -> None:
        self.events: list[KVEvent] = []
        self.enabled = enabled

    def stored(
        self, hashes: list[BlockHash], parent: BlockHash | None, tokens: list[int], bs: int, medium: str
    ):
        if self.enabled and hashes:
            self.events.append(BlockStored(hashes, parent, tokens, bs, medium))

    def removed(self, block_hash: BlockHash, medium: str) -> None:
        if not self.enabled:
            return
        last = self.events[-1] if self.events else None
        if isinstance(last, BlockRemoved) and last.medium == medium:
            last.block_hashes.append(block_hash)
        else:
            self.events.append(BlockRemoved([block_hash], medium))

    def cleared(self) -> None:
        if self.enabled:
            self.events.append(AllBlocksCleared())

    def drain(self) -> list[KVEvent]:
        events, self.events = self.events, []
        return events

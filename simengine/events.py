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
#: vLLM's `KVCacheSpecKind` of a decoder's only KV cache group (full attention; group 0).
SPEC_FULL_ATTENTION = "full_attention"


@dataclass(slots=True)
class BlockStored:
    """Full blocks that entered a medium; `parent_block_hash` chains the first one to the prefix before it."""

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    #: Tokens of all the blocks, in order (len = block_size * len(block_hashes)).
    token_ids: list[int]
    block_size: int
    medium: str
    #: Untagged extra hash keys per block (vLLM's `to_event_extra_keys`: `(cache_salt,)` on a salted first
    #: block, else None); None when the event carries none at all (lower tiers).
    extra_keys: list[tuple | None] | None = None
    #: KV cache group (always 0: one full-attention group) and its kind, as vLLM's GPU pool annotates them;
    #: None for the simulator's lower tiers.
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    #: The LoRA adapter of the request that filled the blocks (vLLM's `lora_int_id` and name); None for the base
    #: model.
    lora_id: int | None = None
    lora_name: str | None = None


@dataclass(slots=True)
class BlockRemoved:
    """Blocks that left a medium (vLLM sends one event per block)."""

    block_hashes: list[BlockHash]
    medium: str
    group_idx: int | None = None


@dataclass(slots=True)
class AllBlocksCleared:
    """Every block of every medium is gone (a prefix cache reset)."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class EventSink:
    """Collects events between two publish points, one event per change as vLLM's block pool queues them."""

    __slots__ = ("events", "enabled")

    def __init__(self, enabled: bool = True) -> None:
        self.events: list[KVEvent] = []
        self.enabled = enabled

    def stored(
        self,
        hashes: list[BlockHash],
        parent: BlockHash | None,
        tokens: list[int],
        bs: int,
        medium: str,
        extra_keys: list[tuple | None] | None = None,
        group_idx: int | None = None,
        spec_kind: str | None = None,
        lora_id: int | None = None,
        lora_name: str | None = None,
    ):
        if self.enabled and hashes:
            self.events.append(
                BlockStored(
                    hashes, parent, tokens, bs, medium, extra_keys, group_idx, spec_kind, lora_id, lora_name
                )
            )

    def removed(self, block_hash: BlockHash, medium: str, group_idx: int | None = None) -> None:
        if self.enabled:
            self.events.append(BlockRemoved([block_hash], medium, group_idx))

    def cleared(self) -> None:
        if self.enabled:
            self.events.append(AllBlocksCleared())

    def drain(self) -> list[KVEvent]:
        events, self.events = self.events, []
        return events

"""The KV index: which holder (instance, DP rank) holds which block in which medium. Pure, no I/O, no gRPC.

Data structures, chosen for a fast `Match` walk and a small per-entry cost in CPython:
- holders are grouped in `BlockSpace`s, one per (model, block size); inside a space every holder owns one bit
  (slots are reused after a holder goes away);
- a space has one dict per medium, `own chain hash -> bitmask of holders`; a block held by one holder stores that
  holder's own `bit` object as the value, so it costs no extra int;
- each holder keeps `engine hash -> own hash` in store order: it resolves `BlockRemoved` and token-less (offload)
  `BlockStored` events, counts the holder's (block, holder) entries and gives the eviction order.

Own hashes come from `tandem.chain_hash` over the event's `token_ids`, chained from the own hash of the event's
parent block, so the index never depends on an engine's hash seed. LoRA blocks chain from a root derived from the
adapter name and the adapter name becomes an alias of the space, so `Match(model=<adapter>)` finds them.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from itertools import islice

import xxhash

from conductor.config import EvictionPolicy
from tandem.chain_hash import lora_root, token_bytes
from tandem.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent, Medium

_xxh3 = xxhash.xxh3_64_intdigest
_TIERS = (Medium.NPU, Medium.CPU, Medium.DISK)


def _drop_bit(tier: dict[int, int], own: int, bit: int) -> bool:
    """Removes a holder's bit from one block's mask in a medium (the entry goes with its last holder)."""
    m = tier.get(own)
    if m is None or not m & bit:
        return False
    m ^= bit
    if m:
        tier[own] = m
    else:
        del tier[own]
    return True


class BlockSpace:
    """Holders of one (model, block size) and their blocks, one `own hash -> holder bitmask` dict per medium."""

    __slots__ = ("model", "block_size", "tiers", "holders", "_free_slots", "_next_slot", "aliases")

    def __init__(self, model: str, block_size: int) -> None:
        self.model = model
        self.block_size = block_size
        # tiers[medium] for Medium.NPU/CPU/DISK (index 0 unused): own hash -> bitmask of holder bits
        self.tiers: list[dict[int, int]] = [{}, {}, {}, {}]
        self.holders: dict[int, Holder] = {}  # slot -> holder
        self._free_slots: list[int] = []  # slots of gone holders, reused lowest first to keep masks short
        self._next_slot = 0
        self.aliases: set[str] = set()  # LoRA adapter names seen on this space's holders

    def new_slot(self) -> int:
        if self._free_slots:
            self._free_slots.sort(reverse=True)
            return self._free_slots.pop()
        self._next_slot += 1
        return self._next_slot - 1

    def free_slot(self, slot: int) -> None:
        self.holders.pop(slot, None)
        self._free_slots.append(slot)


@dataclass(slots=True, eq=False)
class Holder:
    """One engine data-parallel rank: the unit that holds blocks."""

    instance_id: str
    dp_rank: int
    space: BlockSpace  # the (model, block size) the holder indexes into
    slot: int  # bit position in the space's masks
    bit: int  # 1 << slot, shared as the value of blocks only this holder holds
    blocks: dict[int, int] = field(
        default_factory=dict
    )  # engine hash -> own hash, store order (oldest first)
    medium_entries: list[int] = field(default_factory=lambda: [0, 0, 0, 0])  # entries per medium
    limit: int = 0  # the KV blocks the engine rank reports it can hold (0: unknown); bounds `blocks`

    @property
    def key(self) -> tuple[str, int]:
        return (self.instance_id, self.dp_rank)


@dataclass(slots=True)
class IndexCounters:
    """Monotonic counters of the index since start."""

    blocks_stored: int = 0  # (block, holder, medium) entries added
    blocks_removed: int = 0  # entries removed by BlockRemoved
    orphan_blocks: int = 0  # stored blocks whose parent is unknown to the holder (not indexed)
    unresolved_blocks: int = 0  # token-less stores / removals of engine hashes the holder never stored
    evicted_entries: int = 0  # (block, holder) entries dropped by the memory bound
    holder_cap_evicted: int = 0  # (block, holder) entries dropped by the per-holder bound (max_per_holder)
    rejected_entries: int = 0  # new entries refused by the memory bound (policy reject_new)
    unknown_medium: int = 0  # events skipped for a medium that is not NPU, CPU or disk
    holder_clears: int = 0  # AllBlocksCleared, replay-failure clears and holder re-registrations


class KvIndex:
    """Holdings per (instance, DP rank) per medium, bounded to `max_entries` (block, holder) entries in all and
    `max_per_holder` per holder."""

    def __init__(
        self,
        max_entries: int = 20_000_000,
        eviction: EvictionPolicy = "oldest_first",
        max_per_holder: int = 250_000,
    ) -> None:
        self.max_entries = max_entries
        self.max_per_holder = max_per_holder
        self.eviction = eviction
        self.holders: dict[tuple[str, int], Holder] = {}
        self.by_instance: dict[str, dict[int, Holder]] = {}  # instance -> dp_rank -> holder
        self.spaces: dict[tuple[str, int], BlockSpace] = {}  # (model, block_size) -> space
        self.by_model: dict[str, list[BlockSpace]] = {}  # model or LoRA adapter name -> spaces
        self.entries = 0  # (block, holder) entries: sum of len(holder.blocks)
        self.medium_entries = [0, 0, 0, 0]  # (block, holder, medium) entries per medium
        self.counters = IndexCounters()

    # -- holders ------------------------------------------------------------------------------------------------

    def holder(self, instance_id: str, dp_rank: int, model: str, block_size: int) -> Holder:
        """The holder of an engine rank, registered on first use; a changed model or block size starts it afresh."""
        h = self.holders.get((instance_id, dp_rank))
        if h is not None:
            if h.space.model == model and h.space.block_size == block_size:
                return h
            self._drop_holder(h)
        if block_size <= 0:
            raise ValueError(f"instance {instance_id} rank {dp_rank}: block size must be positive")
        space = self.spaces.get((model, block_size))
        if space is None:
            space = self.spaces[(model, block_size)] = BlockSpace(model, block_size)
            self.by_model.setdefault(model, []).append(space)
        slot = space.new_slot()
        h = Holder(instance_id, dp_rank, space, slot, 1 << slot)
        space.holders[slot] = h
        self.holders[h.key] = h
        self.by_instance.setdefault(instance_id, {})[dp_rank] = h
        return h

    def clear_holder(self, instance_id: str, dp_rank: int) -> int:
        """Forgets every block of one engine rank (AllBlocksCleared, lost events); returns the entries dropped."""
        h = self.holders.get((instance_id, dp_rank))
        if h is None:
            return 0
        self.counters.holder_clears += 1
        return self._clear(h)

    def remove_instance(self, instance_id: str) -> int:
        """Drops an instance and all its ranks (it deregistered); returns the entries dropped."""
        ranks = self.by_instance.get(instance_id)
        dropped = 0
        for h in list((ranks or {}).values()):
            dropped += self._drop_holder(h)
        return dropped

    def _drop_holder(self, h: Holder) -> int:
        dropped = self._clear(h)
        h.space.free_slot(h.slot)
        del self.holders[h.key]
        ranks = self.by_instance[h.instance_id]
        del ranks[h.dp_rank]
        if not ranks:
            del self.by_instance[h.instance_id]
        if not h.space.holders:
            self._drop_space(h.space)
        return dropped

    def _drop_space(self, space: BlockSpace) -> None:
        del self.spaces[(space.model, space.block_size)]
        for name in (space.model, *space.aliases):
            spaces = self.by_model.get(name, [])
            if space in spaces:
                spaces.remove(space)
            if not spaces:
                self.by_model.pop(name, None)

    def _clear(self, h: Holder) -> int:
        bit, tiers = h.bit, h.space.tiers
        for medium in _TIERS:
            if not h.medium_entries[medium]:
                continue
            tier = tiers[medium]
            for own in h.blocks.values():
                _drop_bit(tier, own, bit)
            self.medium_entries[medium] -= h.medium_entries[medium]
            h.medium_entries[medium] = 0
        n = len(h.blocks)
        self.entries -= n
        h.blocks = {}
        return n

    # -- events -------------------------------------------------------------------------------------------------

    def apply(self, h: Holder, event: KvEvent) -> None:
        """Applies one decoded event of holder `h`."""
        if type(event) is BlockStored:
            self.store(h, event)
        elif type(event) is BlockRemoved:
            self.remove(h, event.block_hashes, event.medium)
        elif type(event) is AllBlocksCleared:
            self.counters.holder_clears += 1
            self._clear(h)

    def store(self, h: Holder, ev: BlockStored) -> None:
        """`BlockStored`: chain-hash the tokens (or resolve token-less engine hashes) and set `h`'s bit."""
        medium = ev.medium
        if medium not in _TIERS:
            self.counters.unknown_medium += 1
            return
        if ev.lora_name:
            self._alias(h.space, ev.lora_name)
        if ev.token_ids:
            self._store_tokens(h, ev, medium)
        else:
            self._store_known(h, ev.block_hashes, medium)
        if len(h.blocks) > self.max_per_holder or 0 < h.limit < len(h.blocks):
            self._trim_holder(h)
        if self.entries > self.max_entries and self.eviction == "oldest_first":
            self.evict()

    def _alias(self, space: BlockSpace, name: str) -> None:
        if name not in space.aliases and name != space.model:
            space.aliases.add(name)
            self.by_model.setdefault(name, []).append(space)

    def _store_tokens(self, h: Holder, ev: BlockStored, medium: int) -> None:
        bs = h.space.block_size
        hashes = ev.block_hashes
        tokens = ev.token_ids
        n = min(len(hashes), (len(tokens) // 4 if isinstance(tokens, bytes) else len(tokens)) // bs)
        own: int | None
        if ev.parent_block_hash is None:
            own = lora_root(ev.lora_name)
        else:
            own = h.blocks.get(ev.parent_block_hash)
            if own is None:
                self.counters.orphan_blocks += len(hashes)
                return
        buf = token_bytes(tokens)
        step = bs * 4
        n_full = n
        chunks = [buf[p : p + step] for p in range(0, n * step, step)]
        blocks, tier, bit = h.blocks, h.space.tiers[medium], h.bit
        if self.eviction == "reject_new" and self.entries + n > self.max_entries:
            room = max(0, self.max_entries - self.entries)
            fresh = [i for i, eh in enumerate(hashes[:n]) if eh not in blocks]
            if len(fresh) > room:  # keep the chain's first blocks: later ones are useless without them
                self.counters.rejected_entries += n - fresh[room]
                n = fresh[room]
                chunks = chunks[:n]
        # New entries are counted from the dicts' growth rather than per block (this loop is the ingest rate).
        blocks_before, tier_before = len(blocks), len(tier)
        or_added = 0
        setdefault, get, xxh3 = blocks.setdefault, tier.get, _xxh3
        for eh, chunk in zip(hashes, chunks, strict=False):  # hashes may outnumber full token blocks
            own = xxh3(chunk, own)
            prev = setdefault(eh, own)
            if prev is not own and prev != own:  # the engine reused a hash for other tokens: old block gone
                size = len(tier)
                self._unset_all(h, prev)
                tier_before -= size - len(tier)
                blocks[eh] = own
            m = get(own)
            if m is None:
                tier[own] = bit  # the shared bit object: no new int for single-holder blocks
            elif not m & bit:
                tier[own] = m | bit
                or_added += 1
        added_medium = len(tier) - tier_before + or_added
        self.entries += len(blocks) - blocks_before
        self.medium_entries[medium] += added_medium
        h.medium_entries[medium] += added_medium
        self.counters.blocks_stored += added_medium
        if n_full < len(hashes):
            self.counters.orphan_blocks += len(hashes) - n_full  # hashes without a full block of tokens

    def _store_known(self, h: Holder, hashes: list[int], medium: int) -> None:
        blocks, tier, bit = h.blocks, h.space.tiers[medium], h.bit
        added = 0
        for eh in hashes:
            own = blocks.get(eh)
            if own is None:
                self.counters.unresolved_blocks += 1
                continue
            m = tier.get(own)
            if m is None:
                tier[own] = bit
                added += 1
            elif not m & bit:
                tier[own] = m | bit
                added += 1
        self.medium_entries[medium] += added
        h.medium_entries[medium] += added
        self.counters.blocks_stored += added

    def remove(self, h: Holder, hashes: list[int], medium: int) -> None:
        """`BlockRemoved`: clears `h`'s bit in `medium`; forgets the engine hash once no medium holds it."""
        if medium not in _TIERS:
            self.counters.unknown_medium += 1
            return
        blocks, tiers, bit = h.blocks, h.space.tiers, h.bit
        tier = tiers[medium]
        removed = 0
        for eh in hashes:
            own = blocks.get(eh)
            if own is None:
                self.counters.unresolved_blocks += 1
                continue
            if _drop_bit(tier, own, bit):
                removed += 1
            if not (tiers[1].get(own, 0) | tiers[2].get(own, 0) | tiers[3].get(own, 0)) & bit:
                del blocks[eh]
                self.entries -= 1
        self.medium_entries[medium] -= removed
        h.medium_entries[medium] -= removed
        self.counters.blocks_removed += removed

    def _unset_all(self, h: Holder, own: int) -> None:
        bit = h.bit
        for medium in _TIERS:
            tier = h.space.tiers[medium]
            m = tier.get(own)
            if m is not None and m & bit:
                m ^= bit
                if m:
                    tier[own] = m
                else:
                    del tier[own]
                self.medium_entries[medium] -= 1
                h.medium_entries[medium] -= 1

    # -- memory bound ---------------------------------------------------------------------------------------------

    def evict(self) -> int:
        """Policy `oldest_first`: down to 95% of `max_entries`, the largest holder loses its oldest-stored blocks.

        Returns the (block, holder) entries dropped. A chain whose first blocks went no longer matches past them for
        that holder: eviction can only shorten matches, never invent one.
        """
        low = int(self.max_entries * 0.95)
        dropped = 0
        while self.entries > low and self.holders:
            h = max(self.holders.values(), key=lambda x: len(x.blocks))
            n = min(len(h.blocks), self.entries - low)
            if n <= 0:
                break
            for eh in list(islice(h.blocks, n)):
                self._unset_all(h, h.blocks.pop(eh))
            self.entries -= n
            dropped += n
        self.counters.evicted_entries += dropped
        return dropped

    def _trim_holder(self, h: Holder) -> None:
        """The per-holder bound: `h` loses its oldest-stored blocks down to `max_per_holder`, or the capacity its
        engine reports when smaller (whatever the global policy: one holder's flood must not refuse or evict
        other holders' blocks)."""
        n = len(h.blocks) - min(self.max_per_holder, h.limit or self.max_per_holder)
        for eh in list(islice(h.blocks, n)):
            self._unset_all(h, h.blocks.pop(eh))
        self.entries -= n
        self.counters.holder_cap_evicted += n

    # -- introspection --------------------------------------------------------------------------------------------

    def instances(self) -> int:
        """Instances with at least one indexed block."""
        return sum(1 for ranks in self.by_instance.values() if any(h.blocks for h in ranks.values()))

    def approx_bytes(self) -> int:
        """Approximate memory of the index: dict tables plus the hash ints they own."""
        total = 0
        for space in self.spaces.values():
            for tier in space.tiers[1:]:
                total += sys.getsizeof(tier) + 36 * len(tier)
                # masks shared by several holders are ints of their own
                total += (space._next_slot // 30 + 1) * 4 * (0 if len(space.holders) < 2 else len(tier) // 4)
        for h in self.holders.values():
            total += sys.getsizeof(h.blocks) + 36 * len(h.blocks)
        return total

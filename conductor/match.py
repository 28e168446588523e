"""Match: exclusive NPU/CPU/disk prefix hits of a prompt per holder, from the index. Pure, no I/O.

The walk goes down the prompt's chain hashes once for all holders of a space at the same time: `alive` is the
bitmask of holders still matching; at each block the three medium masks are read and intersected with it, and
the walk stops as soon as no holder is left. Each block counts for one medium per holder (NPU, else CPU, else
disk). Counting per holder at every block would cost O(holders) per block; instead, when the masks stay the same
from one block to the next (the usual case: prefixes are shared wholesale) the block costs three dict lookups and
three compares, and where they change only the holders whose state flipped are credited with the run they end.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from conductor.index import BlockSpace, KvIndex
from tandem.chain_hash import chain_hashes, lora_root


@dataclass(slots=True)
class RankHit:
    """Prefix hits of one DP rank; the three counts are mutually exclusive."""

    dp_rank: int
    npu_blocks: int = 0  # leading blocks counted in accelerator memory
    cpu_blocks: int = 0  # leading blocks counted in host memory
    disk_blocks: int = 0  # leading blocks counted on disk tiers

    @property
    def blocks(self) -> int:
        return self.npu_blocks + self.cpu_blocks + self.disk_blocks


@dataclass(slots=True)
class InstanceHit:
    """Prefix hits of one instance: the longest over its ranks, and every rank with a hit."""

    instance_id: str
    block_size: int
    matched_tokens: int  # longest rank's (npu + cpu + disk) * block_size
    best_dp_rank: int  # the rank with that longest match (lowest rank on ties)
    ranks: list[RankHit] = field(default_factory=list)  # ranks with a non-empty match, by rank


@dataclass(slots=True)
class MatchResult:
    """The answer for one prompt."""

    instances: list[InstanceHit]  # non-empty hits, longest first
    truncated: bool = False  # the deadline stopped a walk early (hits may be shorter than the truth)


def walk(space: BlockSpace, hashes: list[int], alive: int, deadline: float | None = None):
    """Per-slot `[npu, cpu, disk]` leading-block counts of the holders in `alive`, and whether the deadline hit.

    A holder's state (NPU, CPU, disk or gone) changes a few times along a prompt; at each block where some state
    changes, only the holders whose bit flipped are touched (`start` and `state` per slot), so the cost is
    O(blocks + state changes), not O(blocks x holders).
    """
    if not hashes:
        return {}, False
    npu, cpu, disk = space.tiers[1], space.tiers[2], space.tiers[3]
    slots = space._next_slot
    start = [0] * slots  # block where the holder's current state began
    state = [-1] * slots  # 0 NPU, 1 CPU, 2 disk, -1 not matching
    counts: dict[int, list[int]] = {}
    rn = rc = rd = -1  # raw masks (medium & alive) of the previous block
    pn = pc = pd = 0  # exclusive masks of the previous block: NPU, CPU and not NPU, disk only
    truncated = False
    i = 0
    for i, h in enumerate(hashes):  # noqa: B007 - i is read after the loop
        n = npu.get(h, 0) & alive
        c = cpu.get(h, 0) & alive
        d = disk.get(h, 0) & alive
        if n == rn and c == rc and d == rd:
            continue  # same masks as the block before: nothing to do (the common case)
        rn, rc, rd = n, c, d
        if c:
            c &= ~n
        if d:
            d &= ~(n | c)
        changed = (n ^ pn) | (c ^ pc) | (d ^ pd)  # holders whose state differs from the block before
        while changed:
            low = changed & -changed
            changed ^= low
            slot = low.bit_length() - 1
            old = state[slot]
            if old >= 0:
                cnt = counts.get(slot)
                if cnt is None:
                    cnt = counts[slot] = [0, 0, 0]
                cnt[old] += i - start[slot]
            state[slot] = 0 if n & low else 1 if c & low else 2 if d & low else -1
            start[slot] = i
        pn, pc, pd = n, c, d
        alive = n | c | d
        if not alive:
            break
        if deadline is not None and time.perf_counter() > deadline:  # checked where the masks change
            truncated = True
            i += 1  # block i was walked
            break
    else:
        i = len(hashes)
    rest = alive
    while rest:
        low = rest & -rest
        rest ^= low
        slot = low.bit_length() - 1
        cnt = counts.get(slot)
        if cnt is None:
            cnt = counts[slot] = [0, 0, 0]
        cnt[state[slot]] += i - start[slot]
    return counts, truncated


def prompt_hashes(
    space: BlockSpace, model: str, token_ids, block_hashes, block_size: int, adapter: str = ""
) -> list[int] | None:
    """The chain hashes to walk in `space`: from the tokens (chained from the adapter's root: `adapter`, else
    `model` when it names an adapter of the space), or the given hashes when their block size fits."""
    root: int | None
    if adapter:
        root = lora_root(adapter)
    else:
        root = lora_root(model) if model != space.model else None
    if token_ids:
        return chain_hashes(token_ids, space.block_size, parent=root)
    if block_hashes and block_size == space.block_size:
        return list(block_hashes)
    return None


def match(
    index: KvIndex,
    model: str,
    token_ids=(),
    block_hashes=(),
    block_size: int = 0,
    candidates=(),
    deadline: float | None = None,
    adapter: str = "",
) -> MatchResult:
    """Hits of a prompt (token ids, or chain hashes of `block_size`) on the instances of `model`.

    `candidates` restricts the answer to these instance ids; `deadline` is a `time.perf_counter()` value;
    `adapter` the LoRA adapter the prompt runs under (only its blocks count; `block_hashes` chained from
    `tandem.chain_hash.adapter_root(adapter)`).
    """
    wanted = set(candidates)
    hits: list[InstanceHit] = []
    truncated = False
    for space in index.by_model.get(model, ()):
        if wanted:
            alive = 0
            for h in space.holders.values():
                if h.instance_id in wanted:
                    alive |= h.bit
        else:
            alive = (1 << space._next_slot) - 1
        if not alive:
            continue
        hashes = prompt_hashes(space, model, token_ids, block_hashes, block_size, adapter)
        if not hashes:
            continue
        counts, cut = walk(space, hashes, alive, deadline)
        truncated |= cut
        bs = space.block_size
        holders = space.holders
        by_instance: dict[str, InstanceHit] = {}
        for slot, (n, c, d) in counts.items():
            owner = holders.get(slot)
            total = n + c + d
            if owner is None or not total:
                continue
            hit = by_instance.get(owner.instance_id)
            if hit is None:
                hit = by_instance[owner.instance_id] = InstanceHit(
                    owner.instance_id, bs, total * bs, owner.dp_rank, []
                )
                hits.append(hit)
            elif total * bs > hit.matched_tokens or (
                total * bs == hit.matched_tokens and owner.dp_rank < hit.best_dp_rank
            ):
                hit.matched_tokens, hit.best_dp_rank = total * bs, owner.dp_rank
            hit.ranks.append(RankHit(owner.dp_rank, n, c, d))
        for hit in by_instance.values():
            if len(hit.ranks) > 1:
                hit.ranks.sort(key=lambda r: r.dp_rank)
    hits.sort(key=lambda x: (-x.matched_tokens, x.instance_id))
    return MatchResult(hits, truncated)

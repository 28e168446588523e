"""The index against a naive reference model, over seeded random event sequences."""

from __future__ import annotations

import random

import pytest

from conductor.index import KvIndex
from conductor.match import match
from tandem.chain_hash import chain_hashes
from tandem.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, Medium

BS = 2
MEDIA = (Medium.NPU, Medium.CPU, Medium.DISK)


def prompts(rng: random.Random) -> list[list[int]]:
    common = [rng.randrange(50) for _ in range(8 * BS)]
    out = []
    for _ in range(4):
        keep = rng.randrange(0, 9) * BS
        out.append(common[:keep] + [rng.randrange(50) for _ in range(8 * BS - keep)])
    return out


class Reference:
    """Per holder: engine hash -> own hash, and own hash -> set of media."""

    def __init__(self) -> None:
        self.emap: dict[tuple, dict[int, int]] = {}
        self.held: dict[tuple, dict[int, set]] = {}

    def store(self, holder, ehs, owns, parent, medium, tokens):
        emap, held = self.emap.setdefault(holder, {}), self.held.setdefault(holder, {})
        if not tokens:
            for eh in ehs:
                if eh in emap:
                    held[emap[eh]].add(medium)
            return
        if parent is not None and parent not in emap:
            return
        for eh, own in zip(ehs, owns, strict=True):
            emap[eh] = own
            held.setdefault(own, set()).add(medium)

    def remove(self, holder, ehs, medium):
        emap, held = self.emap.setdefault(holder, {}), self.held.setdefault(holder, {})
        for eh in ehs:
            if eh in emap:
                held[emap[eh]].discard(medium)
                if not held[emap[eh]]:
                    del held[emap[eh]]
                    del emap[eh]

    def clear(self, holder):
        self.emap[holder], self.held[holder] = {}, {}

    def match(self, owns):
        out = {}
        for holder, held in self.held.items():
            counts = [0, 0, 0]
            for own in owns:
                media = held.get(own)
                if not media:
                    break
                counts[min(MEDIA.index(m) for m in media)] += 1
            if sum(counts):
                out[holder] = tuple(counts)
        return out


@pytest.mark.parametrize(("seed", "n_holders"), [(s, 3) for s in range(6)] + [(s, 70) for s in range(3)])
def test_index_agrees_with_reference_model(seed, n_holders):
    rng = random.Random(seed)
    ps = prompts(rng)
    owns = [chain_hashes(p, BS) for p in ps]
    holders = (
        [("a", 0), ("a", 1), ("b", 0)]
        if n_holders == 3
        else [(f"i{n // 2}", n % 2) for n in range(n_holders)]
    )
    ix, ref = KvIndex(), Reference()

    def eh(holder, own):  # an engine's hash: its own seed, same content -> same hash
        return hash((holder, own)) & (2**64 - 1)

    for _ in range(300 if n_holders == 3 else 1500):
        holder = rng.choice(holders)
        h = ix.holder(*holder, "m", BS)
        k = rng.randrange(len(ps))
        a = rng.randrange(0, 8)
        b = rng.randrange(a + 1, 9)
        ehs = [eh(holder, o) for o in owns[k][a:b]]
        medium = rng.choice(MEDIA)
        op = rng.random()
        if op < 0.5:
            tokens = rng.random() < 0.7
            parent = eh(holder, owns[k][a - 1]) if a else None
            ev = BlockStored(ehs, parent, ps[k][a * BS : b * BS] if tokens else [], BS, medium)
            ix.apply(h, ev)
            ref.store(holder, ehs, owns[k][a:b], parent, medium, tokens)
        elif op < 0.95:
            ix.apply(h, BlockRemoved(ehs, medium))
            ref.remove(holder, ehs, medium)
        else:
            ix.apply(h, AllBlocksCleared())
            ref.clear(holder)
        q = rng.randrange(len(ps))
        got = {
            (hit.instance_id, r.dp_rank): (r.npu_blocks, r.cpu_blocks, r.disk_blocks)
            for hit in match(ix, "m", token_ids=ps[q]).instances
            for r in hit.ranks
        }
        assert got == ref.match(owns[q])
        assert ix.entries == sum(len(m) for m in ref.emap.values())
        for i, medium in enumerate(MEDIA):
            assert ix.medium_entries[medium] == sum(
                1 for held in ref.held.values() for media in held.values() if medium in media
            ), i

"""Index and Match semantics, table-driven: exclusive NPU > CPU > disk walk, DP ranks, duplicates, removals..."""

from __future__ import annotations

import pytest

from conductor.index import KvIndex
from conductor.match import match
from tandem.chain_hash import chain_hashes
from tandem.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, Medium, decode_batch

BS = 4
PROMPT = list(range(100, 132))  # 8 blocks of 4 tokens
NPU, CPU, DISK = Medium.NPU, Medium.CPU, Medium.DISK


def eh(inst: str, rank: int, block: int) -> int:
    """Engine hashes differ per engine (own seed), as in real fleets."""
    return hash((inst, rank, block)) & (2**64 - 1)


def S(inst, rank, first, last, medium=NPU, tokens=True, parent=True, prompt=PROMPT, lora=None):
    """BlockStored of blocks first..last-1 of `prompt` by (inst, rank)."""
    hashes = [eh(inst, rank, b) for b in range(first, last)]
    toks = prompt[first * BS : last * BS] if tokens else []
    par = (eh(inst, rank, first - 1) if first else None) if parent else 12345
    return (inst, rank, BlockStored(hashes, par, toks, BS, medium, lora_name=lora))


def R(inst, rank, blocks, medium=NPU):
    return (inst, rank, BlockRemoved([eh(inst, rank, b) for b in blocks], medium))


def C(inst, rank):
    return (inst, rank, AllBlocksCleared())


def run(ops, index=None, model="m"):
    ix = index or KvIndex()
    for op in ops:
        if op[0] == "gone":
            ix.remove_instance(op[1])
            continue
        inst, rank, ev = op
        ix.apply(ix.holder(inst, rank, model, BS), ev)
    return ix


def answer(ix, prompt=PROMPT, model="m", **kw):
    res = match(ix, model, token_ids=prompt, **kw)
    return {
        h.instance_id: (
            h.matched_tokens,
            h.best_dp_rank,
            {r.dp_rank: (r.npu_blocks, r.cpu_blocks, r.disk_blocks) for r in h.ranks},
        )
        for h in res.instances
    }


CASES = [
    ("npu whole prompt", [S("a", 0, 0, 8)], {"a": (32, 0, {0: (8, 0, 0)})}),
    ("partial trailing block ignored", [S("a", 0, 0, 2)], {"a": (8, 0, {0: (2, 0, 0)})}),
    (
        "exclusive mixed tiers, token-less offloads",
        [S("a", 0, 0, 8, DISK), S("a", 0, 0, 6, CPU, tokens=False), S("a", 0, 0, 3, NPU, tokens=False)],
        {"a": (32, 0, {0: (3, 3, 2)})},
    ),
    (
        "best medium per block, not per prefix",
        [S("a", 0, 0, 4, CPU), S("a", 0, 2, 4, NPU, tokens=False)],
        {"a": (16, 0, {0: (2, 2, 0)})},
    ),
    (
        "walk stops at the first missing block",
        [S("a", 0, 0, 8), R("a", 0, [3])],
        {"a": (12, 0, {0: (3, 0, 0)})},
    ),
    (
        "removed from NPU, still on CPU",
        [S("a", 0, 0, 4), S("a", 0, 0, 4, CPU, tokens=False), R("a", 0, [1])],
        {"a": (16, 0, {0: (3, 1, 0)})},
    ),
    (
        "duplicate BlockStored is harmless",
        [S("a", 0, 0, 8), S("a", 0, 0, 8), S("a", 0, 4, 8)],
        {"a": (32, 0, {0: (8, 0, 0)})},
    ),
    (
        "DP ranks: longest per instance",
        [S("a", 0, 0, 3), S("a", 1, 0, 6, CPU), S("b", 0, 0, 2)],
        {"a": (24, 1, {0: (3, 0, 0), 1: (0, 6, 0)}), "b": (8, 0, {0: (2, 0, 0)})},
    ),
    (
        "DP ranks: tie goes to the lowest rank",
        [S("a", 1, 0, 3), S("a", 0, 0, 3)],
        {"a": (12, 0, {0: (3, 0, 0), 1: (3, 0, 0)})},
    ),
    ("chained event resolves its parent", [S("a", 0, 0, 3), S("a", 0, 3, 8)], {"a": (32, 0, {0: (8, 0, 0)})}),
    ("orphan (unknown parent) is not indexed", [S("a", 0, 4, 8, parent=False)], {}),
    ("token-less store of unknown hashes is ignored", [S("a", 0, 0, 8, CPU, tokens=False)], {}),
    (
        "AllBlocksCleared clears that rank only",
        [S("a", 0, 0, 8), S("a", 1, 0, 2), C("a", 0)],
        {"a": (8, 1, {1: (2, 0, 0)})},
    ),
    ("instance gone", [S("a", 0, 0, 8), S("b", 0, 0, 1), ("gone", "a")], {"b": (4, 0, {0: (1, 0, 0)})}),
    (
        "removal of unknown hash is harmless",
        [S("a", 0, 0, 2), R("a", 0, [7], CPU)],
        {"a": (8, 0, {0: (2, 0, 0)})},
    ),
    ("a different prompt does not match", [S("a", 0, 0, 8, prompt=list(range(32)))], {}),
    (
        "longest first",
        [S("a", 0, 0, 2), S("b", 0, 0, 5, DISK)],
        {"b": (20, 0, {0: (0, 0, 5)}), "a": (8, 0, {0: (2, 0, 0)})},
    ),
]


@pytest.mark.parametrize(("ops", "want"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_match_semantics(ops, want):
    ix = run(ops)
    got = answer(ix)
    assert got == want
    assert list(got) == list(want)  # order: longest first


def test_entries_and_medium_counts_stay_consistent():
    ix = run([S("a", 0, 0, 8), S("a", 0, 0, 8, CPU, tokens=False), S("b", 0, 0, 4, DISK)])
    assert ix.entries == 12 and ix.medium_entries[1:] == [8, 8, 4]
    run([R("a", 0, range(8)), R("a", 0, range(4), CPU)], ix)
    assert ix.entries == 8 and ix.medium_entries[1:] == [0, 4, 4]
    run([C("a", 0), ("gone", "b")], ix)
    assert ix.entries == 0 and ix.medium_entries[1:] == [0, 0, 0]
    assert all(not t for s in ix.spaces.values() for t in s.tiers)
    assert ix.instances() == 0


def test_candidates_model_and_block_hashes():
    ix = run([S("a", 0, 0, 8), S("b", 0, 0, 4)])
    assert set(answer(ix)) == {"a", "b"}
    assert set(answer(ix, candidates=["b", "zzz"])) == {"b"}
    assert answer(ix, model="other") == {}
    res = match(ix, "m", block_hashes=chain_hashes(PROMPT, BS), block_size=BS)
    assert [(h.instance_id, h.matched_tokens) for h in res.instances] == [("a", 32), ("b", 16)]
    assert match(ix, "m", block_hashes=chain_hashes(PROMPT, BS), block_size=8).instances == []


def test_lora_blocks_match_under_the_adapter_name_only():
    ix = run([S("a", 0, 0, 8, lora="sql-lora"), S("b", 0, 0, 2)])
    assert answer(ix, model="sql-lora") == {"a": (32, 0, {0: (8, 0, 0)})}
    assert answer(ix) == {"b": (8, 0, {0: (2, 0, 0)})}


def test_holder_changing_block_size_starts_afresh():
    ix = run([S("a", 0, 0, 8)])
    ix.holder("a", 0, "m", 8)
    assert answer(ix) == {} and ix.entries == 0


def test_engine_reusing_a_hash_for_other_tokens_replaces_the_block():
    ix = run([S("a", 0, 0, 1)])
    other = list(range(4))
    ix.apply(ix.holder("a", 0, "m", BS), BlockStored([eh("a", 0, 0)], None, other, BS, NPU))
    assert answer(ix) == {}
    assert answer(ix, prompt=other) == {"a": (4, 0, {0: (1, 0, 0)})}
    assert ix.entries == 1 and ix.medium_entries[1] == 1


@pytest.mark.parametrize("policy", ["oldest_first", "reject_new"])
def test_memory_bound(policy):
    ix = KvIndex(max_entries=10, eviction=policy)
    run([S("a", 0, 0, 8), S("b", 0, 0, 8)], ix)
    assert ix.entries <= 10
    got = answer(ix)
    if policy == "reject_new":
        assert got == {"a": (32, 0, {0: (8, 0, 0)}), "b": (8, 0, {0: (2, 0, 0)})}
        assert ix.counters.rejected_entries == 6 and ix.counters.orphan_blocks == 0
    else:
        # b overflowed: the largest holder (a) lost its oldest blocks, so its chain no longer matches from the start
        assert ix.counters.evicted_entries >= 6
        assert "a" not in got and got["b"][0] == 32


def test_legacy_and_current_encodings_index_the_same(tmp_path):
    from tests.conductor.fake_engine import batch, stored

    results = []
    for legacy in (True, False):
        ix = KvIndex()
        b = decode_batch(
            batch(
                [
                    stored([1, 2], None, PROMPT[:8], BS, "GPU", legacy),
                    stored([3], 2, PROMPT[8:12], BS, "cpu", legacy),
                ]
            )
        )
        h = ix.holder("a", 0, "m", BS)
        for ev in b.events:
            ix.apply(h, ev)
        results.append(answer(ix))
    assert results[0] == results[1] == {"a": (12, 0, {0: (2, 1, 0)})}


def test_deadline_truncates_conservatively():
    ix = run([S("a", 0, 0, 8), S("b", 0, 0, 8, CPU), S("b", 0, 0, 4, NPU, tokens=False)])
    res = match(ix, "m", token_ids=PROMPT, deadline=0.0)
    assert res.truncated
    for hit in res.instances:
        assert hit.matched_tokens <= 32


def test_match_with_an_adapter_counts_that_adapters_blocks_only():
    from tandem.chain_hash import adapter_root

    # The same prompt cached under two adapters and the base model, on three instances.
    ix = run([S("a", 0, 0, 8, lora="sql"), S("b", 0, 0, 4, lora="chat"), S("c", 0, 0, 2)])
    assert answer(ix, adapter="sql") == {"a": (32, 0, {0: (8, 0, 0)})}
    assert answer(ix, adapter="chat") == {"b": (16, 0, {0: (4, 0, 0)})}
    assert answer(ix) == {"c": (8, 0, {0: (2, 0, 0)})}  # the base model: no adapter's blocks
    assert answer(ix, adapter="never-loaded") == {}
    assert answer(ix, model="sql", adapter="chat") == {"b": (16, 0, {0: (4, 0, 0)})}  # the field wins
    hashes = chain_hashes(PROMPT, BS, parent=adapter_root("sql"))
    res = match(ix, "m", block_hashes=hashes, block_size=BS, adapter="sql")
    assert [(h.instance_id, h.matched_tokens) for h in res.instances] == [("a", 32)]

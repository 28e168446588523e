"""Block pool, tiers and KV cache manager without sockets: caching, prefix hits, eviction, offload, events."""

import pytest

from simengine.block_hash import BlockHasher, to_event_hash
from simengine.events import AllBlocksCleared, BlockRemoved, BlockStored, EventSink
from simengine.kv_cache_manager import KVCacheManager
from simengine.request import Request, SamplingParams

BS = 4


def req(tokens, rid="r"):
    return Request(rid, list(tokens), SamplingParams(max_tokens=4), 0.0)


def run_prefill(kv: KVCacheManager, r: Request) -> None:
    computed = kv.get_computed_blocks(r)
    assert kv.allocate_slots(r, r.num_tokens - computed.num_blocks * BS, computed)
    r.num_computed_tokens = r.num_tokens
    kv.cache_blocks(r, r.num_tokens)


def events_of(sink, cls):
    return [e for e in sink.events if isinstance(e, cls)]


# Event hashes real vLLM 0.32 computes (PYTHONHASHSEED=0) for block [1, 2, 3, 4], then [5, 6, 7, 8] chained on it
# with cache salt "s": vllm.v1.core.kv_cache_utils.hash_block_tokens + maybe_convert_block_hash, run in .venv-vllm.
VLLM_HASHES = {
    "sha256": (10362225831949560093, 11066406391195445260),
    "sha256_cbor": (2164874634404590027, 17325501161450444943),
    "xxhash": (5138823041740264343, 8533696015205237778),
    "xxhash_cbor": (1560721706249274670, 15746645555816441612),
}


@pytest.mark.parametrize("algo", sorted(VLLM_HASHES))
def test_block_hashes_are_vllms(algo):
    hasher = BlockHasher(algo, seed="0")
    first = hasher.hash_block(None, [1, 2, 3, 4])
    second = hasher.hash_block(first, [5, 6, 7, 8], (("cache_salt", "s"),))
    assert (to_event_hash(first), to_event_hash(second)) == VLLM_HASHES[algo]


def test_hash_seed_follows_vllm(monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    assert BlockHasher("sha256").seed == BlockHasher("sha256_cbor").seed == "vllm-none-hash"  # shareable
    assert BlockHasher("xxhash").seed != BlockHasher("xxhash").seed  # random per process, as vLLM
    monkeypatch.setenv("PYTHONHASHSEED", "7")
    assert BlockHasher("xxhash").seed == "7"
    with pytest.raises(ValueError, match="unknown prefix caching hash algorithm"):
        BlockHasher("md5")


def test_cache_salt_changes_the_chain_from_the_first_block():
    kv = KVCacheManager(8, BS, EventSink())
    plain, salted = req(range(8), "a"), req(range(8), "b")
    salted.cache_salt = "tenant-1"
    kv.update_hashes(plain)
    kv.update_hashes(salted)
    assert plain.block_hashes[0] != salted.block_hashes[0] and plain.block_hashes[1] != salted.block_hashes[1]


def test_full_blocks_are_cached_and_published():
    sink = EventSink()
    kv = KVCacheManager(8, BS, sink)
    r = req(range(10))
    run_prefill(kv, r)
    stored = events_of(sink, BlockStored)
    assert len(stored) == 1
    ev = stored[0]
    assert ev.medium == "GPU" and ev.block_size == BS and ev.parent_block_hash is None
    assert ev.block_hashes == r.block_hashes[:2] and ev.token_ids == list(range(8))
    assert len(r.block_ids) == 3  # 10 tokens -> 3 blocks, the last partial and uncached


def test_prefix_hit_reuses_blocks_and_keeps_last_token():
    sink = EventSink()
    kv = KVCacheManager(16, BS, sink)
    a = req(range(12), "a")
    run_prefill(kv, a)
    kv.free(a)
    b = req(list(range(12)) + [99, 98], "b")
    computed = kv.get_computed_blocks(b)
    assert len(computed.npu_blocks) == 3
    same = req(range(12), "c")
    assert len(kv.get_computed_blocks(same).npu_blocks) == 2  # one token is always left to compute
    assert kv.hits == kv.queries == 0  # a lookup alone counts nothing: the scheduler records at admission
    kv.record_prefix_cache_stats(b, 12)
    kv.record_prefix_cache_stats(same, 8)
    assert kv.hits == 12 + 8 and kv.queries == 14 + 12
    same.num_preemptions = 1
    kv.record_prefix_cache_stats(same, 8)  # readmitted after a preemption: vLLM's unexported counters
    assert kv.hits == 12 + 8 and kv.queries == 14 + 12


def test_eviction_emits_block_removed():
    sink = EventSink()
    kv = KVCacheManager(4, BS, sink)
    a = req(range(16), "a")
    run_prefill(kv, a)
    kv.free(a)
    sink.drain()
    b = req(range(100, 116), "b")
    run_prefill(kv, b)
    removed = events_of(sink, BlockRemoved)
    assert removed and all(e.medium == "GPU" and e.group_idx == 0 for e in removed)
    assert all(len(e.block_hashes) == 1 for e in removed)  # one event per block, as vLLM
    assert sorted(h for e in removed for h in e.block_hashes) == sorted(a.block_hashes)


def test_same_content_in_two_blocks_is_stored_and_removed_twice():
    """Two sequences computing the same prompt in one step both cache it (vLLM's n > 1 case)."""
    sink = EventSink()
    kv = KVCacheManager(4, BS, sink)
    a, b = req(range(4), "a"), req(range(4), "b")
    for r in (a, b):
        assert kv.allocate_slots(r, 4, kv.get_computed_blocks(r) if r is a else None)
    for r in (a, b):
        r.num_computed_tokens = 4
        kv.cache_blocks(r, 4)
    stored = events_of(sink, BlockStored)
    assert [e.block_hashes for e in stored] == [a.block_hashes, a.block_hashes]
    assert stored[0].group_idx == 0 and stored[0].kv_cache_spec_kind == "full_attention"
    assert stored[0].extra_keys == [None]
    kv.free(a)
    kv.free(b)
    sink.drain()
    fill = req(range(100, 116), "fill")
    assert kv.allocate_slots(fill, 16, kv.get_computed_blocks(fill))
    assert [e.block_hashes for e in events_of(sink, BlockRemoved)] == [a.block_hashes, a.block_hashes]


def test_offload_to_cpu_then_disk_and_lower_tier_hits():
    sink = EventSink()
    kv = KVCacheManager(4, BS, sink, num_cpu_blocks=3, num_disk_blocks=8, offload=True)
    a = req(range(12), "a")
    run_prefill(kv, a)
    kv.free(a)
    for i, base in enumerate((100, 200, 300)):
        r = req(range(base, base + 12), f"x{i}")
        run_prefill(kv, r)
        kv.free(r)
    media = {(type(e).__name__, e.medium) for e in sink.events if not isinstance(e, AllBlocksCleared)}
    assert ("BlockStored", "CPU") in media and ("BlockRemoved", "GPU") in media
    assert ("BlockRemoved", "CPU") in media and ("BlockStored", "STORAGE") in media
    # a's blocks left the NPU for the CPU tier, and the CPU tier pushed some of them to disk
    again = req(list(range(12)) + [7], "again")
    computed = kv.get_computed_blocks(again)
    assert not computed.npu_blocks and computed.num_cpu + computed.num_disk == 3 and computed.num_disk >= 1
    assert kv.allocate_slots(again, 1, computed)
    assert again.load_tokens_cpu + again.load_tokens_disk == 12 and again.num_computed_tokens == 0


def test_allocation_fails_cleanly_when_full():
    kv = KVCacheManager(2, BS, EventSink())
    r = req(range(12))
    assert not kv.allocate_slots(r, 12, kv.get_computed_blocks(r))
    assert r.block_ids == [] and kv.pool.num_free_blocks == 2


def test_reset_emits_all_blocks_cleared():
    sink = EventSink()
    kv = KVCacheManager(4, BS, sink)
    kv.reset()
    assert isinstance(sink.drain()[-1], AllBlocksCleared)


def test_usage_counts_referenced_blocks_only():
    kv = KVCacheManager(4, BS, EventSink())
    r = req(range(8))
    run_prefill(kv, r)
    assert kv.usage() == 0.5
    kv.free(r)
    assert kv.usage() == 0.0

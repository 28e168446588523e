"""Block pool, tiers and KV cache manager without sockets: caching, prefix hits, eviction, offload, events."""

from simengine.events import AllBlocksCleared, BlockRemoved, BlockStored, EventSink
from simengine.kv_cache_manager import KVCacheManager, hash_block
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


def test_hash_chain_depends_on_prefix():
    a = hash_block(None, [1, 2, 3, 4], 0)
    assert hash_block(None, [1, 2, 3, 4], 0) == a
    assert hash_block(a, [1, 2, 3, 4], 0) != a
    assert hash_block(None, [1, 2, 3, 4], 1) != a
    assert 0 <= a < 2**64


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
    assert kv.hits == 12 + 8 and kv.queries == 12 + 14 + 12


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
    assert removed and all(e.medium == "GPU" for e in removed)
    assert sorted(h for e in removed for h in e.block_hashes) == sorted(a.block_hashes)


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

"""Conductor index benchmark: ingest rate, Match latency, memory per entry. Seeded; prints a table.

    python -m bench.conductor_bench [--seed 7] [--quick]

Measured in one process on one core, against the targets of issue 4:
- ingest: blocks/s through `IngestCore` (freshness + chain hashing + index) from decoded events, and the same
  with msgpack decoding of vLLM payloads included;
- Match p50/p99 from token ids (chain hashing included) for an 8k-token prompt over 64 instances and a 32k-token
  prompt over 512 instances, block size 16, every instance holding a prefix of the prompt across NPU/CPU/disk;
- memory per (block, holder) entry by tracemalloc, with no sharing (worst case) and with shared prefixes.
"""

from __future__ import annotations

import argparse
import gc
import random
import time
import tracemalloc

import msgspec

from conductor.index import KvIndex
from conductor.ingest import IncomingBatch, IngestCore
from conductor.match import match
from tandem.kv_events import BlockStored, Medium, decode_batch

BS = 16
TARGETS = {"ingest": 500_000, "p99_8k": 1.0, "p99_32k": 10.0, "bytes": 200}


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(150_000) for _ in range(n)]


def _ingest_batches(rng: random.Random, n_instances: int, blocks_per_instance: int, per_event: int):
    """Per instance, a chain of `blocks_per_instance` blocks in events of `per_event` blocks (no sharing)."""
    batches = []
    next_hash = 1
    for i in range(n_instances):
        parent = None
        seq = 0
        for _start in range(0, blocks_per_instance, per_event):
            hashes = list(range(next_hash, next_hash + per_event))
            next_hash += per_event
            ev = BlockStored(hashes, parent, _tokens(rng, per_event * BS), BS, Medium.NPU)
            parent = hashes[-1]
            batches.append(IncomingBatch(f"inst-{i}", 0, seq, "m", BS, 0.0, [ev]))
            seq += 1
    return batches


def bench_ingest(rng: random.Random, blocks: int) -> tuple[float, float]:
    batches = _ingest_batches(rng, 8, blocks // 8, 32)
    payloads = [
        msgspec.msgpack.encode(
            [
                0.0,
                [
                    ["BlockStored", e.block_hashes, e.parent_block_hash, e.token_ids, BS, None, "GPU"]
                    for e in b.events
                ],
            ]
        )
        for b in batches
    ]
    core = IngestCore(KvIndex())
    gc.collect()
    t0 = time.perf_counter()
    for b in batches:
        core.batch(b, "bench")
    core_rate = blocks / (time.perf_counter() - t0)
    core = IngestCore(KvIndex())
    t0 = time.perf_counter()
    for b, p in zip(batches, payloads, strict=True):
        d = decode_batch(p)
        core.batch(IncomingBatch(b.instance_id, 0, b.sequence, "m", BS, d.ts, d.events), "bench")
    e2e_rate = blocks / (time.perf_counter() - t0)
    return core_rate, e2e_rate


def bench_memory(rng: random.Random, blocks: int, shared: bool) -> float:
    """Bytes per (block, holder) entry: 16 holders, each a chain of blocks; `shared` gives all the same tokens."""
    n_holders = 16
    per = blocks // n_holders
    common = _tokens(rng, per * BS)
    batches = []
    for i in range(n_holders):
        toks = common if shared else _tokens(rng, per * BS)
        hashes = list(range(i * per + 1, (i + 1) * per + 1))
        batches.append((f"inst-{i}", BlockStored(hashes, None, toks, BS, Medium.NPU)))
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    ix = KvIndex()
    for inst, ev in batches:
        ix.store(ix.holder(inst, 0, "m", BS), ev)
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    return used / ix.entries


def _populate_for_match(rng: random.Random, n_instances: int, prompt_blocks: int):
    """Instances hold prefixes of one prompt: a random length, split NPU then CPU then disk; a few hold it all."""
    prompt = _tokens(rng, prompt_blocks * BS)
    ix = KvIndex()
    eh = 1
    for i in range(n_instances):
        dp = i % 2
        full = i < 4
        length = prompt_blocks if full else rng.randrange(1, prompt_blocks + 1)
        npu = rng.randrange(0, length + 1)
        cpu = rng.randrange(npu, length + 1)
        hashes = list(range(eh, eh + length))
        eh += length
        h = ix.holder(f"inst-{i // 2}", dp, "m", BS)
        ix.store(h, BlockStored(hashes, None, prompt[: length * BS], BS, Medium.DISK))
        ix.store(h, BlockStored(hashes[:cpu], None, [], BS, Medium.CPU))
        ix.store(h, BlockStored(hashes[:npu], None, [], BS, Medium.NPU))
        # unrelated blocks too, so the medium maps are not tiny
        other = _tokens(rng, 64 * BS)
        ix.store(h, BlockStored(list(range(eh, eh + 64)), None, other, BS, Medium.NPU))
        eh += 64
    return ix, prompt


def bench_match(rng: random.Random, holders: int, tokens: int, rounds: int) -> tuple[float, float, int]:
    ix, prompt = _populate_for_match(rng, holders, tokens // BS)
    times = []
    res = None
    for _ in range(rounds):
        t0 = time.perf_counter()
        res = match(ix, "m", token_ids=prompt)
        times.append(time.perf_counter() - t0)
    times.sort()
    p50 = times[len(times) // 2] * 1e3
    p99 = times[min(len(times) - 1, int(len(times) * 0.99))] * 1e3
    return p50, p99, len(res.instances) if res else 0


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--quick", action="store_true", help="smaller runs (CI smoke)")
    args = ap.parse_args(argv)
    rng = random.Random(args.seed)
    scale = 0.1 if args.quick else 1.0
    core_rate, e2e_rate = bench_ingest(rng, int(400_000 * scale) // 256 * 256)
    mem_unique = bench_memory(rng, int(400_000 * scale) // 16 * 16, shared=False)
    mem_shared = bench_memory(rng, int(400_000 * scale) // 16 * 16, shared=True)
    rounds = 50 if args.quick else 400
    p50_8k, p99_8k, n8 = bench_match(rng, 128, 8192, rounds)  # 64 instances x 2 DP ranks
    p50_32k, p99_32k, n32 = bench_match(rng, 1024, 32768, max(20, rounds // 4))  # 512 instances x 2 DP ranks

    rows = [
        (
            "ingest, decoded events (blocks/s)",
            f"{core_rate:,.0f}",
            f">= {TARGETS['ingest']:,}",
            core_rate >= 5e5,
        ),
        (
            "ingest, msgpack payloads (blocks/s)",
            f"{e2e_rate:,.0f}",
            f">= {TARGETS['ingest']:,}",
            e2e_rate >= 5e5,
        ),
        (f"Match 8k tokens / 64 inst p50 (ms), {n8} hit", f"{p50_8k:.3f}", "", True),
        ("Match 8k tokens / 64 inst p99 (ms)", f"{p99_8k:.3f}", "< 1", p99_8k < 1.0),
        (f"Match 32k tokens / 512 inst p50 (ms), {n32} hit", f"{p50_32k:.3f}", "", True),
        ("Match 32k tokens / 512 inst p99 (ms)", f"{p99_32k:.3f}", "< 10", p99_32k < 10.0),
        ("bytes per (block, holder) entry, no sharing", f"{mem_unique:.0f}", "<= 200", mem_unique <= 200),
        ("bytes per (block, holder) entry, shared", f"{mem_shared:.0f}", "<= 200", mem_shared <= 200),
    ]
    print(f"conductor benchmark (seed {args.seed}, block size {BS}, one core)")
    print(f"{'figure':<48} {'value':>14} {'target':>10}  ok")
    for name, value, target, ok in rows:
        print(f"{name:<48} {value:>14} {target:>10}  {'yes' if ok else 'NO'}")


if __name__ == "__main__":
    main()

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

from conductor.convert import batch_from_pb, match_to_pb
from conductor.index import KvIndex
from conductor.ingest import IncomingBatch, IngestCore
from conductor.match import match
from tandem.chain_hash import chain_hashes
from tandem.kv_events import BlockStored, EventBatch, Medium, decode_batch
from tandem.kv_wire import batch_to_pb
from tandem.v1 import conductor_pb2

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


def _populate_for_match(
    rng: random.Random, n_holders: int, prompt_blocks: int, dp_ranks: int = 1, clustered: bool = False
):
    """Holders (instance x DP rank) hold prefixes of one prompt: each its own random length and its own NPU/CPU/disk
    split points (the adversarial case: the walk's masks change at nearly every block); a few hold all of it.
    `clustered`: lengths and tier splits fall on shared 128-block turn boundaries (the common shape)."""
    prompt = _tokens(rng, prompt_blocks * BS)
    ix = KvIndex()
    eh = 1
    for i in range(n_holders):
        dp = i % dp_ranks
        full = i < 4
        length = prompt_blocks if full else rng.randrange(1, prompt_blocks + 1)
        if clustered:  # conversation turns: holders stop at shared boundaries, one tier split per turn
            length = max(1, length // 128 * 128) if not full else length
            npu = rng.choice([0, length // 2 // 128 * 128, length])
            cpu = length
        else:
            npu = rng.randrange(0, length + 1)
            cpu = rng.randrange(npu, length + 1)
        hashes = list(range(eh, eh + length))
        eh += length
        h = ix.holder(f"inst-{i // dp_ranks}", dp, "m", BS)
        ix.store(h, BlockStored(hashes, None, prompt[: length * BS], BS, Medium.DISK))
        ix.store(h, BlockStored(hashes[:cpu], None, [], BS, Medium.CPU))
        ix.store(h, BlockStored(hashes[:npu], None, [], BS, Medium.NPU))
        # unrelated blocks too, so the medium maps are not tiny
        other = _tokens(rng, 64 * BS)
        ix.store(h, BlockStored(list(range(eh, eh + 64)), None, other, BS, Medium.NPU))
        eh += 64
    return ix, prompt


def bench_match(
    rng: random.Random,
    instances: int,
    tokens: int,
    rounds: int,
    dp_ranks: int = 1,
    pb: str = "",
    clustered: bool = False,
):
    """Wall-clock and CPU-time p50/p99 (ms) of `match` from token ids, and the instances hit.

    With `pb` ("tokens" or "hashes"), the service's work is timed: the request parsed from protobuf bytes (token
    ids, or chain hashes computed by the caller) and the answer serialised as a `MatchResponse`.
    """
    ix, prompt = _populate_for_match(rng, instances * dp_ranks, tokens // BS, dp_ranks, clustered)
    if pb == "hashes":  # the coordinator sends chain hashes (`tandem.chain_hash`), computed on its side
        req = conductor_pb2.MatchRequest(
            request_id="r", model="m", block_hashes=chain_hashes(prompt, BS), block_size=BS
        )
    else:
        req = conductor_pb2.MatchRequest(request_id="r", model="m", token_ids=prompt)
    raw = req.SerializeToString()
    wall, cpu = [], []
    res = None
    gc.collect()
    for _ in range(rounds):
        t0, c0 = time.perf_counter(), time.thread_time()
        if pb:
            req = conductor_pb2.MatchRequest.FromString(raw)
            res = match(ix, req.model, req.token_ids, req.block_hashes, req.block_size)
            match_to_pb(req.request_id, res).SerializeToString()
        else:
            res = match(ix, "m", token_ids=prompt)
        wall.append(time.perf_counter() - t0)
        cpu.append(time.thread_time() - c0)

    def pct(xs: list[float], q: float) -> float:
        xs = sorted(xs)
        return xs[min(len(xs) - 1, int(len(xs) * q))] * 1e3

    return pct(wall, 0.5), pct(wall, 0.99), pct(cpu, 0.99), len(res.instances) if res else 0


def bench_grpc_ingest(rng: random.Random, blocks: int) -> float:
    """Conductor side of `Ingest`: protobuf bytes -> message -> core batch -> index (what one agent stream costs)."""
    batches = _ingest_batches(rng, 8, blocks // 8, 32)
    wire = [
        conductor_pb2.IngestRequest(
            batch=batch_to_pb(EventBatch(0.0, b.events), b.instance_id, 0, b.sequence, "m", BS, False)
        ).SerializeToString()
        for b in batches
    ]
    core = IngestCore(KvIndex())
    parse = conductor_pb2.IngestRequest.FromString
    gc.collect()
    t0 = time.perf_counter()
    for raw in wire:
        core.batch(batch_from_pb(parse(raw).batch), "bench")
    return blocks / (time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--quick", action="store_true", help="smaller runs (CI smoke)")
    args = ap.parse_args(argv)
    gc.freeze()  # as `tandem conductor` does once started: imports stay out of full collections
    rng = random.Random(args.seed)
    scale = 0.1 if args.quick else 1.0
    core_rate, e2e_rate = bench_ingest(rng, int(400_000 * scale) // 256 * 256)
    mem_unique = bench_memory(rng, int(400_000 * scale) // 16 * 16, shared=False)
    mem_shared = bench_memory(rng, int(400_000 * scale) // 16 * 16, shared=True)
    grpc_rate = bench_grpc_ingest(rng, int(400_000 * scale) // 256 * 256)
    rounds = 50 if args.quick else 400
    m8 = bench_match(rng, 64, 8192, rounds)
    m32 = bench_match(rng, 512, 32768, max(20, rounds // 4))
    m8dp = bench_match(rng, 64, 8192, rounds, dp_ranks=2)
    m32dp = bench_match(rng, 512, 32768, max(20, rounds // 4), dp_ranks=2)
    m8pb = bench_match(rng, 64, 8192, rounds, pb="tokens")
    m32pb = bench_match(rng, 512, 32768, max(20, rounds // 4), pb="tokens")
    m8h = bench_match(rng, 64, 8192, rounds, pb="hashes")
    m32h = bench_match(rng, 512, 32768, max(20, rounds // 4), pb="hashes")
    m32c = bench_match(rng, 512, 32768, max(20, rounds // 4), pb="hashes", clustered=True)

    def ok(v: bool) -> str:
        return "yes" if v else "NO"

    rows = [
        (
            "ingest, decoded events -> index (blocks/s)",
            f"{core_rate:,.0f}",
            ">= 500,000",
            ok(core_rate >= 5e5),
        ),
        (
            "ingest, Ingest protobuf -> index (blocks/s)",
            f"{grpc_rate:,.0f}",
            ">= 500,000",
            ok(grpc_rate >= 5e5),
        ),
        (
            "ingest, msgpack payloads -> index (blocks/s)",
            f"{e2e_rate:,.0f}",
            ">= 500,000",
            ok(e2e_rate >= 5e5),
        ),
    ]
    for label, (p50, p99, cpu99, hit), limit in (
        ("8k tok / 64 inst", m8, 1.0),
        ("32k tok / 512 inst", m32, 10.0),
        ("8k tok / 64 inst x 2 DP", m8dp, 1.0),
        ("32k tok / 512 inst x 2 DP", m32dp, 10.0),
        ("8k / 64, pb token_ids in, pb out", m8pb, 1.0),
        ("32k / 512, pb token_ids in, pb out", m32pb, 10.0),
        ("8k / 64, pb block_hashes in, pb out", m8h, 1.0),
        ("32k / 512, pb block_hashes in, pb out", m32h, 10.0),
        ("32k / 512, pb hashes, clustered prefixes", m32c, 10.0),
    ):
        rows.append((f"Match {label}: p50 wall (ms), {hit} hit", f"{p50:.3f}", "", ""))
        rows.append((f"Match {label}: p99 wall (ms)", f"{p99:.3f}", f"< {limit:g}", ok(p99 < limit)))
        rows.append((f"Match {label}: p99 CPU (ms)", f"{cpu99:.3f}", f"< {limit:g}", ok(cpu99 < limit)))
    rows += [
        ("bytes per (block, holder) entry, no sharing", f"{mem_unique:.0f}", "<= 200", ok(mem_unique <= 200)),
        ("bytes per (block, holder) entry, shared", f"{mem_shared:.0f}", "<= 200", ok(mem_shared <= 200)),
    ]
    print(f"conductor benchmark (seed {args.seed}, block size {BS}, one core)")
    print(f"{'figure':<72} {'value':>12} {'target':>11}  ok")
    for name, value, target, good in rows:
        print(f"{name:<72} {value:>12} {target:>11}  {good}")


if __name__ == "__main__":
    main()

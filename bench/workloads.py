"""Seeded workloads where prefix caching matters, as rows in the Mooncake traces' format.

Each row has `timestamp` (ms), `input_length`, `output_length` and `hash_ids` (512-token blocks; equal leading ids
mean a reusable prefix, exactly as in the Mooncake traces), so every tool that replays a trace (the fleet
simulator, the real-time replay) replays these too. Arrivals are Poisson at one request (or session start) per
second of nominal time; the benchmarks compress time to reach a load level. Ingredients:

- multi-tenant shared system prompts: tenants with Zipf popularity, each with its own system prompt;
- popular retrieved documents: documents with Zipf popularity placed after the system prompt (reusable within a
  tenant), then the user's question;
- multi-turn sessions: each turn's prompt is the previous turn's prompt plus its answer plus a new message, after
  a think time;
- agent loops: the same growth in quick steps (tool calls), seconds apart.

Named workloads (`GENERATORS`): `tenants_rag` (the first two) and `sessions_agents` (the last two, sessions also
opening with an application's shared system prompt). `ideal_hit_rate` gives a workload's hit rate with one
infinite cache, the ceiling every router is measured against.
"""

from __future__ import annotations

import bisect
import itertools
import random
from collections.abc import Callable, Iterable

from bench.trace import TRACE_BLOCK

#: Hash-id namespaces (the traces' own ids stay below 2^24).
_SYSTEM, _DOC, _UNIQUE = 1 << 40, 2 << 40, 3 << 40


def _zipf_sampler(rng: random.Random, n: int, s: float) -> Callable[[], int]:
    weights = [1.0 / (k + 1) ** s for k in range(n)]
    cum = list(itertools.accumulate(weights))
    total = cum[-1]
    return lambda: bisect.bisect_left(cum, rng.random() * total)


def _row(at_s: float, hash_ids: list[int], last_tokens: int, output: int) -> dict:
    """A row whose last block holds `last_tokens` (1..512) tokens."""
    length = (len(hash_ids) - 1) * TRACE_BLOCK + last_tokens
    return {
        "timestamp": round(at_s * 1000, 3),
        "input_length": length,
        "output_length": output,
        "hash_ids": list(hash_ids),
    }


def tenants_rag(requests: int, seed: int) -> list[dict]:
    """Multi-tenant shared system prompts (1-4k tokens, 32 tenants, Zipf 1.1) and popular retrieved documents
    (60% of requests, 1-3 documents of 0.5-2k tokens from 400 per tenant, Zipf 1.0), then a unique question."""
    rng = random.Random(seed)
    tenants, docs_per_tenant = 32, 400
    tenant_of = _zipf_sampler(rng, tenants, 1.1)
    doc_of = _zipf_sampler(rng, docs_per_tenant, 1.0)
    system_blocks = [rng.randint(2, 8) for _ in range(tenants)]
    doc_blocks = [rng.randint(1, 4) for _ in range(tenants * docs_per_tenant)]
    unique = itertools.count(_UNIQUE)
    rows, t = [], 0.0
    for _ in range(requests):
        t += rng.expovariate(1.0)
        tenant = tenant_of()
        ids = [_SYSTEM + tenant * 64 + i for i in range(system_blocks[tenant])]
        if rng.random() < 0.6:
            for _ in range(rng.choice((1, 1, 2, 3))):
                doc = tenant * docs_per_tenant + doc_of()
                ids += [_DOC + doc * 8 + i for i in range(doc_blocks[doc])]
        ids += [next(unique) for _ in range(rng.randint(0, 1))]
        ids.append(next(unique))
        rows.append(_row(t, ids, rng.randint(32, TRACE_BLOCK), rng.randint(16, 256)))
    return rows


def sessions_agents(requests: int, seed: int, max_blocks: int = 16) -> list[dict]:
    """Multi-turn chat sessions (3-12 turns, think time 15 s on average) and agent loops (5-20 steps 1-3 s
    apart, each adding 0.5-1k tokens of tool output), 60/40, each opening with one of 8 applications' system
    prompts (1-3k tokens, Zipf 1.0); a session ends at its last turn or when its context would pass
    `max_blocks` blocks. Session starts are Poisson; rows are sorted by time and cut at `requests`."""
    rng = random.Random(seed)
    apps = 8
    app_of = _zipf_sampler(rng, apps, 1.0)
    app_blocks = [rng.randint(2, 6) for _ in range(apps)]
    unique = itertools.count(_UNIQUE)
    rows: list[dict] = []
    start = 0.0
    # Sessions run concurrently: generate enough of them, then keep the earliest `requests` rows.
    while len(rows) < requests * 1.3 + 50:
        start += rng.expovariate(0.35)
        app = app_of()
        ids = [_SYSTEM + app * 64 + i for i in range(app_blocks[app])]
        agent = rng.random() < 0.4
        steps = rng.randint(5, 20) if agent else rng.randint(3, 12)
        t = start
        for _ in range(steps):
            ids = ids + [next(unique) for _ in range(rng.randint(1, 2) if agent else rng.randint(0, 1))]
            ids.append(next(unique))  # this turn's last (partial) block
            if len(ids) > max_blocks:
                break
            output = rng.randint(16, 96) if agent else rng.randint(32, 256)
            rows.append(_row(t, ids, rng.randint(32, TRACE_BLOCK), output))
            # The next prompt keeps this one's full blocks (its partial last block is rewritten with the answer).
            ids = ids[:-1] + [next(unique)]
            t += rng.uniform(1.0, 3.0) if agent else rng.expovariate(1 / 15.0)
    rows.sort(key=lambda r: r["timestamp"])
    return rows[:requests]


GENERATORS: dict[str, Callable[[int, int], list[dict]]] = {
    "tenants_rag": tenants_rag,
    "sessions_agents": sessions_agents,
}


def generate(name: str, requests: int, seed: int) -> list[dict]:
    """`requests` rows of the named workload (`GENERATORS`), a pure function of (name, requests, seed)."""
    try:
        gen = GENERATORS[name]
    except KeyError:
        raise ValueError(f"unknown workload {name!r} (known: {', '.join(GENERATORS)})") from None
    return gen(requests, seed)


def ideal_hit_rate(prompts: Iterable, block_size: int = 16, warmup: int = 0) -> float:
    """Prompt tokens found in one infinite cache (every earlier prompt's full blocks, chain-hashed), over all
    prompt tokens, counting only prompts after the first `warmup` (which still fill the cache). `prompts` holds
    token lists, or (length, chain hashes) pairs already computed."""
    from tandem.chain_hash import chain_hashes

    seen: set[int] = set()
    hit = total = 0
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, tuple):
            length, hashes = prompt
        else:
            length, hashes = len(prompt), chain_hashes(prompt, block_size)
        n = 0
        for h in hashes:
            if h not in seen:
                break
            n += 1
        if i >= warmup:
            # As an engine: at least the last token is computed (a fully cached prompt recomputes one block).
            hit += min(n * block_size, (length - 1) // block_size * block_size)
            total += length
        seen.update(hashes)
    return hit / total if total else float("nan")

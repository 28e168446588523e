"""Trace arrivals for the fleet simulator: Mooncake rows, time-compressed, tiled into independent copies.

A fleet of N instances is fed `copies` copies of the trace whose hash ids are disjoint (copy c adds
`c * HASH_STRIDE` to every id), so prefix sharing stays within a copy, as between independent user populations,
while the load per instance stays that of the base configuration. Prompt tokens are made on arrival from the hash
ids exactly as `bench.trace` makes them (same tokens for copy 0), and dropped when the request finishes, so that
a 512-instance replay does not hold every prompt in memory.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from bench.trace import TRACE_BLOCK, PromptTokens

#: Offset between the hash ids of two copies of the trace (larger than any id in the traces).
HASH_STRIDE = 1 << 32


@dataclass(frozen=True, slots=True)
class Arrival:
    """One request of the replay, in simulated seconds."""

    at_s: float  # arrival time
    hash_ids: tuple[int, ...]  # 512-token prefix blocks (already offset for its copy)
    input_len: int  # prompt tokens (after the cap)
    output_len: int  # output tokens (after the cap)
    key: int  # unique, seeds the request's tail tokens


def arrivals(rows: list[dict], rate_scale: float, copies: int = 1, seed: int = 0) -> list[Arrival]:
    """Arrivals of `copies` copies of `rows`, timestamps divided by `rate_scale`; copy 0 keeps its exact times,
    every other copy is shifted by a seeded offset of up to two mean inter-arrival gaps."""
    if not rows:
        return []
    span = (rows[-1]["timestamp"] - rows[0]["timestamp"]) / 1000 / rate_scale
    gap = span / max(len(rows) - 1, 1)
    rng = random.Random(seed)
    out: list[Arrival] = []
    for c in range(copies):
        shift = 0.0 if c == 0 else rng.uniform(0.0, 2.0 * gap)
        offset = c * HASH_STRIDE
        for i, row in enumerate(rows):
            blocks = tuple(h + offset for h in row["hash_ids"][: -(-row["input_length"] // TRACE_BLOCK)])
            at = row["timestamp"] / 1000 / rate_scale + shift
            out.append(Arrival(at, blocks, row["input_length"], row["output_length"], c * len(rows) + i))
    out.sort(key=lambda a: (a.at_s, a.key))
    return out


class PromptSource(PromptTokens):
    """Prompt token ids of arrivals, exactly as `bench.trace` makes them for the same rows (copy 0)."""

    def tokens(self, a: Arrival) -> list[int]:
        return self.prompt(a.hash_ids, a.input_len, a.key)

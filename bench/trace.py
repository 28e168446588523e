"""Mooncake FAST'25 traces as requests: token ids synthesised per hash id, arrivals time-scaled.

Each trace line has `timestamp` (ms), `input_length`, `output_length` and `hash_ids` (chained 512-token prefix
blocks: equal ids mean a reusable prefix). A hash id always becomes the same 512 tokens; the tokens after the last
full block are unique to the request, as the trace's README says to do.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

TRACE_BLOCK = 512
DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "mooncake"


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request to replay."""

    at_s: float  # arrival, seconds after the start of the replay (already scaled)
    prompt: list[int]
    max_tokens: int


def find_trace(name: str) -> Path:
    """`conversation`, `synthetic`, or a path."""
    path = Path(name)
    if path.exists():
        return path
    for candidate in (
        DATA / f"{name}_trace.jsonl",
        Path.cwd().parent / "shared/data/mooncake" / f"{name}_trace.jsonl",
    ):
        if candidate.exists():
            return candidate
    raise FileNotFoundError(f"trace {name!r} not found (looked in {DATA})")


def _block_tokens(hash_id: int, vocab: int, cache: dict[int, list[int]]) -> list[int]:
    tokens = cache.get(hash_id)
    if tokens is None:
        rng = random.Random(hash_id * 7919 + 17)
        tokens = cache[hash_id] = [rng.randrange(vocab) for _ in range(TRACE_BLOCK)]
    return tokens


def load_trace(
    name: str,
    limit: int,
    time_scale: float,
    vocab: int,
    seed: int = 0,
    max_input: int = 0,
    max_output: int = 0,
) -> list[TraceRequest]:
    """The first `limit` requests; arrival times divided by `time_scale`; inputs/outputs optionally capped."""
    cache: dict[int, list[int]] = {}
    rng = random.Random(seed)
    out: list[TraceRequest] = []
    with open(find_trace(name)) as f:
        for line in f:
            if len(out) >= limit:
                break
            row = json.loads(line)
            prompt: list[int] = []
            length = row["input_length"]
            for hash_id in row["hash_ids"]:
                prompt.extend(_block_tokens(hash_id, vocab, cache))
            prompt = prompt[:length]
            prompt.extend(rng.randrange(vocab) for _ in range(length - len(prompt)))
            if max_input:
                prompt = prompt[:max_input]
            output = max(1, row["output_length"])
            if max_output:
                output = min(output, max_output)
            out.append(TraceRequest(row["timestamp"] / 1000 / time_scale, prompt, output))
    return out

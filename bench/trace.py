"""Mooncake FAST'25 traces as requests: prompts synthesised per hash id, arrivals time-scaled.

Each trace line has `timestamp` (ms), `input_length`, `output_length` and `hash_ids` (chained 512-token prefix
blocks: equal ids mean a reusable prefix). A hash id always becomes the same 512 tokens; the tokens after the last
full block are unique to the request, as the trace's README says to do.

Tokens are drawn from the tokenizer's whole-word ids (" word"), so a prompt is also a text that tokenizes back to
exactly those ids: every router gets the same text prompt (`sglang-router` accepts only text prompts), and the
engines see the token ids the fleet simulator uses.
"""

from __future__ import annotations

import itertools
import json
import random
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

TRACE_BLOCK = 512
DATA = Path(__file__).resolve().parent / "data" / "mooncake"  # copied in, unchanged: see SOURCE.md there


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request to replay."""

    at_s: float  # arrival, seconds after the start of the replay (already scaled)
    prompt: list[int]  # token ids
    max_tokens: int
    text: str = ""  # the same prompt as text (tokenizes back to `prompt`)


def find_trace(name: str) -> Path:
    """`conversation`, `synthetic`, or a path."""
    path = Path(name)
    if path.exists():
        return path
    candidate = DATA / f"{name}_trace.jsonl"
    if candidate.exists():
        return candidate
    raise FileNotFoundError(f"trace {name!r} not found (looked in {DATA})")


class PromptTokens:
    """Prompt token ids from hash ids: each hash id always gives the same 512 tokens; the tail after the last
    full block comes from a generator seeded by (seed, request key). Block tokens are cached, bounded."""

    def __init__(self, token_ids: Sequence[int], seed: int = 0, cache_blocks: int = 200_000) -> None:
        self.ids = list(token_ids)
        self.seed = seed
        self.cache_blocks = cache_blocks
        self._blocks: dict[int, list[int]] = {}

    def _draw(self, seed: int, n: int) -> list[int]:
        """`n` ids drawn by a generator seeded with `seed` (16 random bits per id; the modulo bias is harmless)."""
        raw = array("H", random.Random(seed).randbytes(2 * n))
        ids, size = self.ids, len(self.ids)
        return [ids[x % size] for x in raw]

    def block(self, hash_id: int) -> list[int]:
        tokens = self._blocks.get(hash_id)
        if tokens is None:
            if len(self._blocks) >= self.cache_blocks:
                self._blocks.clear()  # re-made identically when needed again
            tokens = self._blocks[hash_id] = self._draw(hash_id * 7919 + 17, TRACE_BLOCK)
        return tokens

    def prompt(self, hash_ids: Sequence[int], length: int, key: int) -> list[int]:
        out: list[int] = []
        for h in hash_ids:
            if len(out) >= length:
                break
            out.extend(self.block(h))
        del out[length:]
        if len(out) < length:
            out.extend(self._draw(self.seed * 1_000_003 + key + (1 << 40), length - len(out)))
        return out


def load_rows(
    name: str, limit: int, max_input: int = 0, max_output: int = 0, seed: int = 0, skip: int = 0
) -> list[dict]:
    """`limit` rows of a trace after its first `skip`, or of a generated workload (`bench.workloads`, made with
    `seed`), lengths capped."""
    from bench.workloads import GENERATORS, generate

    if name in GENERATORS:
        source = generate(name, limit, seed)
    else:
        source = (json.loads(line) for line in itertools.islice(open(find_trace(name)), skip, None))
    rows = []
    for row in source:
        if len(rows) >= limit:
            break
        if max_input:
            row["input_length"] = min(row["input_length"], max_input)
        row["output_length"] = max(1, row["output_length"])
        if max_output:
            row["output_length"] = min(row["output_length"], max_output)
        rows.append(row)
    return rows


def load_trace(
    name: str,
    limit: int,
    time_scale: float,
    tokenizer,
    seed: int = 0,
    max_input: int = 0,
    max_output: int = 0,
) -> list[TraceRequest]:
    """The first `limit` requests of a trace or generated workload (`load_rows`); arrival times divided by
    `time_scale`; inputs/outputs optionally capped.
    `tokenizer` is Tandem's (`tandem.tokenizer.load_tokenizer`): its `word_ids` make the prompts."""
    source = PromptTokens(tokenizer.word_ids, seed)
    out: list[TraceRequest] = []
    for i, row in enumerate(load_rows(name, limit, max_input, max_output, seed)):
        prompt = source.prompt(row["hash_ids"], row["input_length"], i)
        text = tokenizer.decode(prompt)
        out.append(TraceRequest(row["timestamp"] / 1000 / time_scale, prompt, row["output_length"], text))
    return out

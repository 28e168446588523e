"""The Mooncake traces kept in the repository and their replay as prompts (bench/trace.py)."""

from __future__ import annotations

import collections
import itertools
import json
import math
import re

import pytest

from bench.trace import DATA, TRACE_BLOCK, find_trace, load_trace
from tandem.tokenizer import load_tokenizer


def readme_table() -> dict[str, tuple[int, int, int]]:
    """`{trace name: (requests, average input, average output)}` as the README next to the traces states them."""
    rows = re.findall(
        r"^\| (\w+)_trace\.jsonl \| ([\d,]+) \| ([\d,]+) \| ([\d,]+) \|",
        (DATA / "README.md").read_text(),
        re.M,
    )
    return {name: tuple(int(x.replace(",", "")) for x in numbers) for name, *numbers in rows}


@pytest.mark.parametrize("name", ["conversation", "synthetic"])
def test_trace_in_the_repository_is_the_one_its_readme_describes(name):
    path = find_trace(name)
    assert path.parent == DATA and (DATA / "SOURCE.md").exists()
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    requests, avg_input, avg_output = readme_table()[name]
    assert len(rows) == requests
    assert round(sum(r["input_length"] for r in rows) / len(rows)) == avg_input
    assert round(sum(r["output_length"] for r in rows) / len(rows)) == avg_output
    # the format bench/trace.py relies on: arrivals in order, one hash id per started 512-token block, ids new
    # to the trace numbered in order of first use (a later prompt reuses a prefix by repeating its ids)
    assert all(a["timestamp"] <= b["timestamp"] for a, b in itertools.pairwise(rows))
    assert all(len(r["hash_ids"]) == math.ceil(r["input_length"] / TRACE_BLOCK) for r in rows)
    seen = -1
    for r in rows:
        for h in r["hash_ids"]:
            assert h <= seen + 1
            seen = max(seen, h)


def test_conversation_arrivals_come_in_groups_three_seconds_apart_as_the_readme_says():
    rows = [json.loads(line) for line in find_trace("conversation").read_text().splitlines()]
    groups = collections.Counter(r["timestamp"] for r in rows)
    instants = sorted(groups)
    assert len(instants) == 1180 and max(groups.values()) == 28 and min(groups.values()) > 1
    assert all(2997 <= b - a <= 3003 for a, b in itertools.pairwise(instants))
    assert "1,180 instants 3 s apart" in (DATA / "README.md").read_text()


def test_replayed_prompts_share_exactly_the_blocks_their_hash_ids_share():
    tok = load_tokenizer(None)
    reqs = load_trace("conversation", limit=40, time_scale=2.0, tokenizer=tok, max_input=4096)
    rows = [json.loads(line) for line in find_trace("conversation").read_text().splitlines()[:40]]
    by_hash: dict[int, list[int]] = {}
    for req, row in zip(reqs, rows, strict=True):
        assert req.at_s == row["timestamp"] / 1000 / 2.0
        assert len(req.prompt) == min(row["input_length"], 4096) and req.max_tokens == row["output_length"]
        assert tok.encode(req.text) == req.prompt
        full = min(row["input_length"], 4096) // TRACE_BLOCK
        for i, h in enumerate(row["hash_ids"][:full]):
            block = req.prompt[i * TRACE_BLOCK : (i + 1) * TRACE_BLOCK]
            assert by_hash.setdefault(h, block) == block  # the same id is the same 512 tokens everywhere
    blocks = list(by_hash.values())
    assert len({tuple(b) for b in blocks}) == len(blocks)  # and different ids are different tokens
    assert len(by_hash) < sum(len(r["hash_ids"]) for r in rows)  # the sample does reuse prefixes


def test_unknown_trace_names_the_directory_it_looked_in():
    with pytest.raises(FileNotFoundError, match="bench/data/mooncake"):
        find_trace("nope")

"""The seeded reuse workloads: deterministic, in the traces' format, with the reuse they promise."""

from __future__ import annotations

import pytest

from bench.fleet.workload import PromptSource, arrivals
from bench.trace import load_rows
from bench.workloads import GENERATORS, generate, ideal_hit_rate
from tandem.tokenizer import load_tokenizer


@pytest.mark.parametrize("name", list(GENERATORS))
def test_seeded_rows_in_trace_format(name):
    a, b, c = generate(name, 300, 1), generate(name, 300, 1), generate(name, 300, 2)
    assert a == b and a != c and len(a) == 300
    assert all(r["timestamp"] <= s["timestamp"] for r, s in zip(a, a[1:], strict=False))
    for row in a:
        blocks = -(-row["input_length"] // 512)
        assert len(row["hash_ids"]) == blocks and row["output_length"] > 0


@pytest.mark.parametrize(("name", "floor"), [("tenants_rag", 0.5), ("sessions_agents", 0.5)])
def test_reuse_heavy_workloads_have_a_high_ideal_hit_rate(name, floor):
    ids = load_tokenizer(None).word_ids
    rows = load_rows(name, 400, 8192, 64, seed=0)
    src = PromptSource(ids, 0)
    assert ideal_hit_rate((src.tokens(a) for a in arrivals(rows, 1.0)), 16, warmup=100) > floor


def test_ideal_hit_rate_counts_leading_blocks_once_seen():
    p1 = list(range(64))
    p2 = list(range(48)) + [999] * 16
    # p2's first 3 blocks were seen; a fully seen prompt still computes its last block.
    assert ideal_hit_rate([p1, p2], 16) == pytest.approx(48 / 128)
    assert ideal_hit_rate([p1, p1], 16, warmup=1) == pytest.approx(48 / 64)

"""bench.kv_relay end to end at a small size: real conductor and relay processes index exactly what the engines
sent, for both shapes (the rate itself is a benchmark's figure, not a test's)."""

from __future__ import annotations

import msgspec

from bench import kv_relay


def test_every_block_sent_is_indexed_exactly_once_the_run_ends(tmp_path):
    out = tmp_path / "kv-relay.md"
    assert (
        kv_relay.main(["--engines", "2", "--batches", "150", "--capacity", "4096", "--output", str(out)]) == 0
    )
    rows = {
        line.split("|")[1].strip(): line for line in out.read_text().splitlines() if line.startswith("| ")
    }
    for shape, blocks in (("prefill", 2 * 150 * 128), ("decode", 2 * 150 * 4)):
        cells = [c.strip() for c in rows[shape].split("|")[1:-1]]
        assert cells[1] == "300" and cells[3] == f"{blocks:,}" and cells[-1] == "yes", rows[shape]


def test_an_engines_cache_keeps_its_newest_blocks():
    per_batch, per_event, _ = kv_relay.SHAPES["prefill"]
    stored = removed = 0
    for payload in kv_relay.engine_batches(0, "prefill", 1000, 7, 20):
        _, events, _ = msgspec.msgpack.decode(payload)
        stored += sum(len(e["block_hashes"]) for e in events if e["type"] == "BlockStored")
        removed += sum(len(e["block_hashes"]) for e in events if e["type"] == "BlockRemoved")
    assert stored == 20 * per_batch * per_event and stored - removed == 1000

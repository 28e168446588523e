"""Decoder of vLLM KV event batches and the shared chain hash."""

from __future__ import annotations

import msgspec
import pytest

from tandem.chain_hash import chain_hashes, lora_root
from tandem.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvEventDecodeError,
    Medium,
    decode_batch,
    engine_hash,
    normalize_medium,
    split_message,
    split_replay_reply,
)
from tests.conductor.fake_engine import batch, cleared, removed, stored


@pytest.mark.parametrize(
    ("raw", "want"),
    [
        ("GPU", Medium.NPU),
        ("gpu", Medium.NPU),
        ("NPU", Medium.NPU),
        ("CPU", Medium.CPU),
        ("cpu", Medium.CPU),
        ("STORAGE", Medium.DISK),
        ("FS", Medium.DISK),
        ("OBJ", Medium.DISK),
        ("disk", Medium.DISK),
        (None, Medium.NPU),
        ("TAPE", Medium.UNSPECIFIED),
    ],
)
def test_medium_normalisation(raw, want):
    assert normalize_medium(raw) == want


@pytest.mark.parametrize(
    ("raw", "want"),
    [
        (5, 5),
        (-1, 2**64 - 1),
        (b"\x00" * 24 + (7).to_bytes(8, "big"), 7),
        (bytes(range(32)), int.from_bytes(bytes(range(24, 32)), "big")),
    ],
)
def test_engine_hash(raw, want):
    assert engine_hash(raw) == want


@pytest.mark.parametrize("legacy", [True, False])
@pytest.mark.parametrize("map_outer", [False, True])
def test_decode_both_encodings(legacy, map_outer):
    events = [
        stored([1, 2], None, list(range(8)), 4, "GPU", legacy),
        stored([b"\x00" * 31 + b"\x03"], 2, [], 4, "cpu", legacy),
        removed([1], "STORAGE", legacy),
        cleared(legacy),
    ]
    b = decode_batch(batch(events, dp_rank=3, map_outer=map_outer, ts=12.5))
    assert b.ts == 12.5 and b.dp_rank == 3
    assert b.events == [
        BlockStored([1, 2], None, list(range(8)), 4, Medium.NPU),
        BlockStored([3], 2, [], 4, Medium.CPU),
        BlockRemoved([1], Medium.DISK),
        AllBlocksCleared(),
    ]


def test_decode_current_with_omitted_defaults_and_old_two_field_batch():
    ev = {"type": "BlockStored", "block_hashes": [9], "parent_block_hash": None, "token_ids": [1, 2],
          "block_size": 2, "lora_id": None, "medium": None, "lora_name": None}  # fmt: skip
    b = decode_batch(msgspec.msgpack.encode([1.0, [ev]]))
    assert b.dp_rank is None
    assert b.events == [BlockStored([9], None, [1, 2], 2, Medium.NPU)]
    # an old legacy event without medium and lora_name
    b = decode_batch(msgspec.msgpack.encode([1.0, [["BlockStored", [9], None, [1, 2], 2, None]]]))
    assert b.events[0].medium == Medium.NPU


@pytest.mark.parametrize(
    "payload", [b"\xc1", msgspec.msgpack.encode(5), msgspec.msgpack.encode([1.0, [["Nope"]]])]
)
def test_decode_errors(payload):
    with pytest.raises(KvEventDecodeError):
        decode_batch(payload)


def test_frames():
    seq = (42).to_bytes(8, "big")
    assert split_message([b"t", seq, b"p"]) == (b"t", 42, b"p")
    assert split_replay_reply([b"", seq, b"p"]) == (42, b"p")
    assert split_replay_reply([b"", b"topic", seq, b"p"]) == (42, b"p")
    assert split_replay_reply([b"", b"\xff" * 8, b""]) == (-1, b"")


def test_chain_hash_properties():
    toks = list(range(40))
    full = chain_hashes(toks, 8)
    assert len(full) == 5  # full blocks only
    assert chain_hashes(toks[:39], 8) == full[:4]
    assert chain_hashes(toks[8:], 8, parent=full[0]) == full[1:]  # chaining from a parent
    assert chain_hashes([99] + toks[1:], 8)[1] != full[1]  # a block's hash depends on every block before it
    assert chain_hashes(toks, 8, parent=lora_root("adapter")) != full
    assert chain_hashes([], 8) == []
    with pytest.raises(ValueError):
        chain_hashes(toks, 0)

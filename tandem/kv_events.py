"""Decoder of vLLM's ZMQ KV event batches into plain dataclasses (see docs/wire.md).

Both encodings are read:
- legacy (vLLM <= ~0.23, msgspec `array_like` + `tag`): a batch is `[ts, [events], dp_rank?]` and each event an array
  with its tag first, `["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, ...]`;
- current: each event a map with a `"type"` tag whose defaulted fields may be missing; the batch itself is an array
  or (seen once) a map `{"ts", "events", "data_parallel_rank"}`.

Media are normalised here, once: "GPU"/"NPU" -> NPU, "CPU" -> CPU, "STORAGE"/"FS"/"OBJ"/"DISK" -> DISK, case
insensitive; a missing medium means the engine's own (GPU) pool. Byte block hashes become their last 8 bytes read as a
big-endian uint64 (vLLM's `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES` form); integer hashes are taken modulo 2**64.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, NewType

import msgspec

#: A block hash as an engine published it (its own algorithm and seed), as an unsigned 64-bit integer.
EngineHash = NewType("EngineHash", int)

_U64 = (1 << 64) - 1
_decoder = msgspec.msgpack.Decoder()

#: The 8-byte big-endian sequence frame vLLM uses as the end marker of a replay (-1).
END_SEQ = b"\xff" * 8


class Medium(enum.IntEnum):
    """Normalised KV medium; the values equal `tandem.v1.Medium` so conversion is `int()`."""

    UNSPECIFIED = 0
    NPU = 1
    CPU = 2
    DISK = 3


_MEDIA = {
    "GPU": Medium.NPU,
    "NPU": Medium.NPU,
    "CPU": Medium.CPU,
    "STORAGE": Medium.DISK,
    "FS": Medium.DISK,
    "OBJ": Medium.DISK,
    "DISK": Medium.DISK,
}


class KvEventDecodeError(ValueError):
    """A payload that is not a KV event batch in either encoding."""


def normalize_medium(medium: str | None) -> Medium:
    """The normalised medium of an engine's string; None (older engines) is the engine's GPU/NPU pool.

    Unknown strings give `Medium.UNSPECIFIED`, which ingest rejects.
    """
    if medium is None:
        return Medium.NPU
    return _MEDIA.get(medium.upper(), Medium.UNSPECIFIED)


def engine_hash(value: int | bytes) -> EngineHash:
    """An engine block hash as uint64: integers modulo 2**64, bytes by their last 8 bytes, big-endian."""
    if isinstance(value, int):
        return EngineHash(value & _U64)
    if isinstance(value, (bytes, bytearray, memoryview)):
        return EngineHash(int.from_bytes(bytes(value)[-8:], "big"))
    raise KvEventDecodeError(f"block hash of type {type(value).__name__}")


@dataclass(slots=True)
class BlockStored:
    """Blocks entered a medium."""

    block_hashes: list[int]  # engine hashes (EngineHash), chain order
    parent_block_hash: int | None  # engine hash of the block before the first; None at a chain's start
    token_ids: (
        list[int] | bytes
    )  # block_size tokens per block (or packed, `chain_hash.token_bytes`); may be empty
    block_size: int  # tokens per block as reported with the event (0 when unknown)
    medium: Medium  # normalised medium
    lora_id: int | None = None  # LoRA adapter id; None for the base model
    lora_name: str | None = None  # LoRA adapter name; None for the base model


@dataclass(slots=True)
class BlockRemoved:
    """Blocks left a medium."""

    block_hashes: list[int]  # engine hashes (EngineHash)
    medium: Medium  # normalised medium


@dataclass(slots=True)
class AllBlocksCleared:
    """Every block of the engine (rank) was dropped."""


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(slots=True)
class EventBatch:
    """One published batch: what the engine sent in one ZMQ message."""

    ts: float  # engine wall-clock time of the batch, seconds since the epoch
    events: list[KvEvent] = field(default_factory=list)  # in the engine's order
    dp_rank: int | None = None  # the data-parallel rank the engine reported, if any


def _hashes(values: Any) -> list[int]:
    if not isinstance(values, list):
        raise KvEventDecodeError("block_hashes is not a list")
    if not values:
        return values
    try:  # the common case, unsigned integers, checked in C
        if min(values) >= 0 and type(values[0]) is int:
            return values
    except TypeError:
        pass
    return [engine_hash(v) for v in values]


def _opt_hash(value: Any) -> int | None:
    return None if value is None else engine_hash(value)


def _stored(
    hashes: Any, parent: Any, tokens: Any, block_size: Any, lora_id: Any, medium: Any, lora_name: Any
):
    return BlockStored(
        block_hashes=_hashes(hashes),
        parent_block_hash=_opt_hash(parent),
        token_ids=tokens if type(tokens) is list else list(tokens or ()),
        block_size=int(block_size or 0),
        medium=normalize_medium(medium),
        lora_id=lora_id,
        lora_name=lora_name or None,
    )


def _event_from_array(raw: list) -> KvEvent:
    tag = raw[0] if raw else None
    if tag == "BlockStored":
        f = raw + [None] * (8 - len(raw))
        return _stored(f[1], f[2], f[3], f[4], f[5], f[6], f[7])
    if tag == "BlockRemoved":
        return BlockRemoved(_hashes(raw[1]), normalize_medium(raw[2] if len(raw) > 2 else None))
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    raise KvEventDecodeError(f"unknown event tag {tag!r}")


def _event_from_map(raw: dict) -> KvEvent:
    tag = raw.get("type")
    if tag == "BlockStored":
        g = raw.get
        return _stored(
            g("block_hashes"), g("parent_block_hash"), g("token_ids"), g("block_size"), g("lora_id"), g("medium"),
            g("lora_name"),
        )  # fmt: skip
    if tag == "BlockRemoved":
        return BlockRemoved(_hashes(raw.get("block_hashes")), normalize_medium(raw.get("medium")))
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    raise KvEventDecodeError(f"unknown event type {tag!r}")


def decode_event(raw: Any) -> KvEvent:
    """One event in either encoding."""
    if isinstance(raw, list):
        return _event_from_array(raw)
    if isinstance(raw, dict):
        return _event_from_map(raw)
    raise KvEventDecodeError(f"event of type {type(raw).__name__}")


def decode_batch(payload: bytes) -> EventBatch:
    """A msgpack batch payload (the last frame of a live or replayed message) in either encoding."""
    try:
        raw = _decoder.decode(payload)
    except msgspec.DecodeError as exc:
        raise KvEventDecodeError(f"not msgpack: {exc}") from None
    if isinstance(raw, dict):
        ts, events, dp_rank = raw.get("ts"), raw.get("events"), raw.get("data_parallel_rank")
    elif isinstance(raw, list) and len(raw) >= 2:
        ts, events = raw[0], raw[1]
        dp_rank = raw[2] if len(raw) > 2 else None
    else:
        raise KvEventDecodeError("batch is neither [ts, events, dp_rank] nor a map")
    if not isinstance(events, list):
        raise KvEventDecodeError("batch events is not a list")
    try:
        return EventBatch(ts=float(ts or 0.0), events=[decode_event(e) for e in events], dp_rank=dp_rank)
    except (TypeError, ValueError, AttributeError, IndexError) as exc:
        if isinstance(exc, KvEventDecodeError):
            raise
        raise KvEventDecodeError(f"malformed event: {exc}") from None


def decode_seq(frame: bytes) -> int:
    """The 8-byte big-endian sequence frame; -1 for the replay end marker."""
    if len(frame) != 8:
        raise KvEventDecodeError(f"sequence frame of {len(frame)} bytes")
    return int.from_bytes(frame, "big", signed=True)


def encode_seq(seq: int) -> bytes:
    """The 8-byte big-endian sequence frame (the replay request and the live message's middle frame)."""
    return seq.to_bytes(8, "big", signed=True)


def split_message(frames: list[bytes]) -> tuple[bytes, int, bytes]:
    """`(topic, seq, payload)` of a live message `[topic, seq, payload]` or `[seq, payload]`."""
    if len(frames) == 3:
        return frames[0], decode_seq(frames[1]), frames[2]
    if len(frames) == 2:
        return b"", decode_seq(frames[0]), frames[1]
    raise KvEventDecodeError(f"live message of {len(frames)} frames")


def split_replay_reply(frames: list[bytes]) -> tuple[int, bytes]:
    """`(seq, payload)` of a DEALER-side replay reply `["", seq, payload]` or `["", topic, seq, payload]`."""
    if frames and frames[0] == b"":
        frames = frames[1:]
    if len(frames) == 2:
        return decode_seq(frames[0]), frames[1]
    if len(frames) == 3:
        return decode_seq(frames[1]), frames[2]
    raise KvEventDecodeError(f"replay reply of {len(frames)} frames")

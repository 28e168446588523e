"""KV events between their core dataclasses (`tandem.kv_events`) and the `tandem.v1` messages the node agent sends
to the conductor's Ingest: the one wire conversion both sides share (no gRPC here, only generated messages)."""

from __future__ import annotations

from typing import cast

from tandem.chain_hash import token_bytes
from tandem.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, KvEvent, Medium
from tandem.v1 import common_pb2, conductor_pb2

_MEDIA = {int(m): m for m in Medium}


def _pb_medium(medium: Medium) -> common_pb2.Medium:
    """`Medium`'s values equal `tandem.v1.Medium`'s: the conversion is `int()` (typed for the stubs)."""
    return cast(common_pb2.Medium, int(medium))


def _medium(value: int) -> Medium:
    return _MEDIA.get(value, Medium.UNSPECIFIED)


def events_from_pb(events) -> list[KvEvent]:
    """`KvEvent` messages as core events; unknown media become `Medium.UNSPECIFIED` (rejected by the index)."""
    out: list[KvEvent] = []
    for ev in events:
        which = ev.WhichOneof("event")
        if which == "block_stored":
            s = ev.block_stored
            out.append(
                BlockStored(
                    block_hashes=list(s.block_hashes),
                    parent_block_hash=s.parent_block_hash if s.HasField("parent_block_hash") else None,
                    token_ids=list(s.token_ids) if s.token_ids else s.token_ids_le32,
                    block_size=s.block_size,
                    medium=_medium(s.medium),
                    lora_id=s.lora_id if s.HasField("lora_id") else None,
                    lora_name=s.lora_name or None,
                )
            )
        elif which == "block_removed":
            r = ev.block_removed
            out.append(BlockRemoved(list(r.block_hashes), _medium(r.medium)))
        elif which == "all_blocks_cleared":
            out.append(AllBlocksCleared())
    return out


def _fill_event(target: conductor_pb2.KvEvent, ev: KvEvent) -> None:
    """Writes a core event into `target`, a `KvEvent` message, in place (no submessage built and copied)."""
    if isinstance(ev, BlockStored):
        stored = target.block_stored
        stored.SetInParent()
        stored.block_hashes.extend(ev.block_hashes)
        stored.token_ids_le32 = token_bytes(ev.token_ids)
        stored.block_size = ev.block_size
        stored.medium = _pb_medium(ev.medium)
        if ev.lora_name:
            stored.lora_name = ev.lora_name
        if ev.parent_block_hash is not None:
            stored.parent_block_hash = ev.parent_block_hash
        if ev.lora_id is not None:
            stored.lora_id = ev.lora_id
    elif isinstance(ev, BlockRemoved):
        removed = target.block_removed
        removed.SetInParent()
        removed.block_hashes.extend(ev.block_hashes)
        removed.medium = _pb_medium(ev.medium)
    else:
        target.all_blocks_cleared.SetInParent()


def batch_to_pb(
    batch: EventBatch,
    instance_id: str,
    dp_rank: int,
    sequence: int,
    model: str,
    block_size: int,
    replayed: bool,
    capacity_blocks: int = 0,
) -> conductor_pb2.KvEventBatch:
    """A decoded engine batch as a `KvEventBatch` message (the node agent's direction), its events written in place."""
    msg = conductor_pb2.KvEventBatch(
        instance_id=instance_id,
        dp_rank=dp_rank,
        sequence=sequence,
        model=model,
        block_size=block_size,
        replayed=replayed,
        capacity_blocks=capacity_blocks,
    )
    for ev in batch.events:
        _fill_event(msg.events.add(), ev)
    if batch.ts > 0:
        msg.engine_time.FromNanoseconds(int(batch.ts * 1e9))
    return msg

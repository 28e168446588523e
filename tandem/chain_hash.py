"""Chain hashes of token blocks, shared by the conductor (indexing engine events) and the coordinator (prompts).

A block's hash is `xxh3_64(tokens of the block as little-endian uint32, seed=hash of the previous block)`; the
first block of a prompt is seeded with `ROOT_SEED`. Only full blocks are hashed. Because the conductor re-hashes
the engines' `token_ids` with this function, it never depends on an engine's hash algorithm or seed.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence
from typing import NewType

import xxhash

#: A block hash computed by this module (never an engine's hash).
ChainHash = NewType("ChainHash", int)

#: Seed of the first block of a chain.
ROOT_SEED = 0

_xxh3 = xxhash.xxh3_64_intdigest
_BIG_ENDIAN = sys.byteorder == "big"


def lora_root(lora_name: str | None) -> int:
    """The chain root of a LoRA adapter's blocks: pass it as `parent` to hash an adapter's prompt.

    The base model (None or "") chains from `ROOT_SEED`.
    """
    return ROOT_SEED if not lora_name else _xxh3(lora_name.encode())


def token_bytes(token_ids: Sequence[int] | array | bytes) -> bytes:
    """Token ids as contiguous little-endian uint32 bytes (the input of the hash); bytes pass through."""
    if isinstance(token_ids, bytes):
        return token_ids
    arr = token_ids if isinstance(token_ids, array) and token_ids.typecode == "I" else array("I", token_ids)
    if _BIG_ENDIAN:  # pragma: no cover - little-endian everywhere we run
        arr = array("I", arr)
        arr.byteswap()
    return arr.tobytes()


def chain_hashes(
    token_ids: Sequence[int] | array | bytes, block_size: int, parent: int | None = None
) -> list[int]:
    """Hashes of the full blocks of `token_ids`, in order, chained from `parent` (a chain hash) or the root.

    `token_ids` may also be `token_bytes(...)` (little-endian uint32). A trailing partial block is ignored.
    `block_size` must be positive.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    n_tokens = len(token_ids) // 4 if isinstance(token_ids, bytes) else len(token_ids)
    n_blocks = n_tokens // block_size
    if n_blocks == 0:
        return []
    buf = token_bytes(token_ids)  # slicing bytes (a 64-byte copy) beats memoryview slices here
    step = block_size * 4
    h = ROOT_SEED if parent is None else parent
    out: list[int] = []
    append, xxh3 = out.append, _xxh3
    for pos in range(0, n_blocks * step, step):
        h = xxh3(buf[pos : pos + step], h)
        append(h)
    return out

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


def adapter_root(adapter: str | None) -> int:
    """The chain root of a LoRA adapter's blocks: pass it as `parent` to hash a prompt run under `adapter`.

    vLLM (0.32, `vllm/v1/core/kv_cache_utils.py`, `_gen_lora_extra_hash_keys`) adds the adapter to every block's
    hash as an extra key, `("lora", lora_name, lora_path)` (the name, not the int id, since the int id is per
    process), and its KV events carry it as `lora_name` (`lora_id` is kept, deprecated). Because a block's hash
    covers its parent's, seeding the chain with the adapter's name gives the same partition as vLLM's per-block
    key: two prompts get equal hashes here exactly when vLLM's are equal for the same adapter, and blocks cached
    under one adapter are never found for another adapter or for the base model (`tests/vllm/test_lora_hashes.py`
    checks this against vLLM's own `hash_block_tokens`). vLLM also keys on the adapter's path, which events do not
    carry: a name re-pointed at another path makes the engine miss where the conductor still sees a hit (a worse
    routing guess, never a wrong cache hit: the engine checks its own hashes).

    The base model (None or "") chains from `ROOT_SEED`.
    """
    return ROOT_SEED if not adapter else _xxh3(adapter.encode())


#: Former name of `adapter_root`.
lora_root = adapter_root


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

"""vLLM's prefix-caching block hashes (`--prefix-caching-hash-algo`), so simengine's KV events carry the very
integers a real vLLM 0.32 engine publishes for the same tokens.

Facts read from vLLM 0.32 (vllm/v1/core/kv_cache_utils.py, vllm/utils/hashing.py):
- a block's hash is `hash_fn((parent_hash, tuple(token_ids), extra_keys))`, where `parent_hash` is the previous
  block's full digest, or `NONE_HASH` for the first block, and `extra_keys` is None or a tuple of tagged keys
  (here only `("cache_salt", salt)` on the first block);
- `sha256` / `xxhash` serialise with pickle (highest protocol), `sha256_cbor` / `xxhash_cbor` with canonical CBOR;
  sha256 gives 32 bytes, xxhash xxh3-128 16 bytes;
- `NONE_HASH = hash_fn(seed)`: seed = PYTHONHASHSEED when set, else "vllm-none-hash" for the sha256 algorithms
  and 32 random bytes (hex) for the xxhash ones (not reproducible across processes, as in vLLM);
- events carry `int.from_bytes(digest, "big") & (2**64 - 1)` (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES, on by default).

The engine chains on full digests and keys its cache by the 64-bit event form (a collision needs 2**32 blocks).
Not copied from vLLM: the same public algorithm, written from the facts above.
"""

from __future__ import annotations

import hashlib
import os
import pickle
from collections.abc import Callable, Sequence
from typing import Any

import xxhash

ALGORITHMS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")
#: vLLM's seed for the cryptographic algorithms when PYTHONHASHSEED is unset.
DEFAULT_SEED = "vllm-none-hash"
_MASK64 = (1 << 64) - 1


def _pickle(obj: Any) -> bytes:
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def _cbor(obj: Any) -> bytes:
    import cbor2  # only the *_cbor algorithms need it

    return cbor2.dumps(obj, canonical=True)


def _sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


_FUNCTIONS: dict[str, tuple[Callable[[Any], bytes], Callable[[bytes], bytes]]] = {
    "sha256": (_pickle, _sha256),
    "sha256_cbor": (_cbor, _sha256),
    "xxhash": (_pickle, xxhash.xxh3_128_digest),
    "xxhash_cbor": (_cbor, xxhash.xxh3_128_digest),
}


def resolve_seed(algo: str, seed: str | None = None) -> str:
    """The string NONE_HASH is derived from: the explicit seed, else PYTHONHASHSEED, else vLLM's default for
    the algorithm (fixed for sha256*, random for xxhash*)."""
    if seed is not None:
        return seed
    env = os.environ.get("PYTHONHASHSEED")
    if env is not None:
        return env
    if algo.startswith("xxhash"):
        return os.urandom(32).hex()
    return DEFAULT_SEED


def to_event_hash(digest: bytes) -> int:
    """The wire form of a block hash in KV events: the digest's last 8 bytes as an unsigned big-endian int."""
    return int.from_bytes(digest, "big") & _MASK64


class BlockHasher:
    """Chain hashing of full blocks with one of vLLM's algorithms and a resolved seed."""

    __slots__ = ("algo", "seed", "none_hash", "_serialise", "_digest")

    def __init__(self, algo: str = "sha256", seed: str | None = None) -> None:
        if algo not in _FUNCTIONS:
            raise ValueError(
                f"unknown prefix caching hash algorithm {algo!r}: choose from {', '.join(ALGORITHMS)}"
            )
        self.algo = algo
        self._serialise, self._digest = _FUNCTIONS[algo]
        self.seed = resolve_seed(algo, seed)
        #: Parent of every chain's first block.
        self.none_hash = self.hash_object(self.seed)

    def hash_object(self, obj: Any) -> bytes:
        return self._digest(self._serialise(obj))

    def hash_block(
        self, parent: bytes | None, token_ids: Sequence[int], extra_keys: tuple[Any, ...] | None = None
    ) -> bytes:
        """Full digest of one block given its parent's digest (None for the first block)."""
        return self._digest(self._serialise((parent or self.none_hash, tuple(token_ids), extra_keys)))

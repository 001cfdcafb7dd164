"""Chained block hashes for prefix caching.

A full block's hash covers its parent's hash, its own token ids and optional extra keys (a cache salt on
the first block), so equal hashes mean equal prefixes, not merely equal blocks. SHA-256 over a fixed
byte encoding is the same in every process and on every machine, unlike Python's salted `hash()` of
strings; that matters once several scheduler replicas or a KV-aware router compare hashes.
"""

from __future__ import annotations

import hashlib
from array import array

# The parent of every first block. A constant, so that hashes agree across processes and restarts.
ROOT_HASH = hashlib.sha256(b"stepwire/prefix-cache/v1").digest()


def hash_block(parent: bytes, token_ids, extra: bytes = b"") -> bytes:
    h = hashlib.sha256(parent)
    # int64 keeps any vocabulary id exact; the token part has a fixed length, so `extra` cannot alias it.
    h.update(array("q", token_ids).tobytes())
    if extra:
        h.update(extra)
    return h.digest()


def extend_block_hashes(hashes: list[bytes], token_ids: list[int], block_size: int, extra: bytes = b"") -> None:
    """Append the hashes of the full blocks of `token_ids` that `hashes` does not cover yet."""
    start = len(hashes)
    num_full = len(token_ids) // block_size
    parent = hashes[-1] if hashes else ROOT_HASH
    for i in range(start, num_full):
        parent = hash_block(parent, token_ids[i * block_size:(i + 1) * block_size], extra if i == 0 else b"")
        hashes.append(parent)

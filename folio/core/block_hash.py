"""Block hashes for prefix caching: a full block is named by a SHA-256 chained over its parent's hash,
its token ids and, through the root of the chain, the request's cache_salt.

Chaining makes a block's hash stand for its whole prefix, so equal hashes mean equal KV. SHA-256 makes a
collision (two different prefixes sharing a name, hence wrong KV) practically impossible, at a cost of
about a microsecond per block. Tenants with different cache_salt values never share a block.
"""

from __future__ import annotations

import hashlib
from array import array
from typing import Optional


def root_hash(cache_salt: Optional[str]) -> bytes:
    """The parent of a request's first block."""
    return hashlib.sha256(b"folio-prefix-cache\0" + (cache_salt or "").encode()).digest()


def hash_block(parent: bytes, token_ids: list[int]) -> bytes:
    return hashlib.sha256(parent + array("q", token_ids).tobytes()).digest()


def extend_block_hashes(hashes: list[bytes], token_ids: list[int], block_size: int,
                        cache_salt: Optional[str]) -> None:
    """Append the hashes of the full blocks of token_ids that `hashes` does not cover yet."""
    for i in range(len(hashes), len(token_ids) // block_size):
        parent = hashes[i - 1] if i else root_hash(cache_salt)
        hashes.append(hash_block(parent, token_ids[i * block_size:(i + 1) * block_size]))

"""The hash chain that names a full block of tokens: the scheduler's prefix cache keys its
blocks by it, and a client routing requests between data-parallel replicas hashes
prompts with it, so a prompt goes where its prefix was computed."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

BlockHash = bytes


def chain_hashes(
    token_ids: Sequence[int], block_size: int, parent: BlockHash | None = None, start: int = 0
) -> list[BlockHash]:
    """Hashes of the full blocks of ``token_ids`` from block ``start`` on, chained from the
    hash ``parent`` of block ``start - 1``. A 128-bit BLAKE2 digest: a collision would hand
    one request another's KV, so Python's ``hash`` (64 bits, not collision resistant) will
    not do."""
    num_full = len(token_ids) // block_size
    if num_full <= start:
        return []
    data = np.asarray(token_ids[start * block_size : num_full * block_size], np.int32)
    hashes = []
    digest = parent or b""
    for i in range(num_full - start):
        block = data[i * block_size : (i + 1) * block_size].tobytes()
        digest = hashlib.blake2b(digest + block, digest_size=16).digest()
        hashes.append(digest)
    return hashes

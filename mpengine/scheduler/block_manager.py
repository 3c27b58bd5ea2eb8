"""KV cache blocks: a free queue, reference counts and a prefix cache, in pure Python.

A block holds ``block_size`` consecutive token positions of one sequence. Blocks are shared
(reference count > 1) by the ``n`` samples of one request and by requests whose prompts
start alike. Verbs come in pairs: ``can_allocate`` / ``allocate``, ``share`` / ``free``,
``lookup`` / ``register``.

Prefix caching (vLLM's semantics). A *full* block whose contents are known is named by a
hash chain: ``hash(parent's hash, the block's token ids)``, so equal hashes mean equal
prefixes up to and including the block. ``register`` records a computed full block under
its hash; ``lookup`` finds the longest chain of registered blocks for a token sequence.
Freed blocks keep their hash and stay findable until the space is needed: the free queue
is ordered least-recently-freed first, ``allocate`` takes from its head and evicts a cached
block it takes, and a cached block that is looked up while free leaves the queue. A block is
on the free queue exactly when nothing references it.
"""

from __future__ import annotations

from collections import OrderedDict

from mpengine.prefix_hash import BlockHash


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, caching: bool = False) -> None:
        if num_blocks < 0 or block_size < 1:  # 0 blocks: an encoder, no KV cache
            raise ValueError(
                f"need num_blocks >= 0 and block_size >= 1, got {num_blocks}, {block_size}"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.caching = caching
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._refs = [0] * num_blocks
        self._hash_of: list[BlockHash | None] = [None] * num_blocks
        self._cached: dict[BlockHash, int] = {}  # hash -> block holding it
        self.num_evicted = 0

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` positions."""
        return -(-num_tokens // self.block_size)

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free)

    def allocate(self, num_blocks: int) -> list[int]:
        """Take blocks from the head of the free queue (evicting what they cached)."""
        if num_blocks > len(self._free):
            raise RuntimeError(f"out of KV blocks: want {num_blocks}, {len(self._free)} free")
        block_ids = []
        for _ in range(num_blocks):
            block_id, _ = self._free.popitem(last=False)
            block_hash = self._hash_of[block_id]
            if block_hash is not None:
                self._hash_of[block_id] = None
                del self._cached[block_hash]
                self.num_evicted += 1
            self._refs[block_id] = 1
            block_ids.append(block_id)
        return block_ids

    def share(self, block_ids: list[int]) -> list[int]:
        """Take another reference on blocks some sequence already holds."""
        for block_id in block_ids:
            assert self._refs[block_id] > 0, f"sharing free block {block_id}"
            self._refs[block_id] += 1
        return list(block_ids)

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference on each block; a block with none left joins the free queue's
        tail, last block first (a sequence's tail is the least likely to be shared, so it
        is evicted first)."""
        for block_id in reversed(block_ids):
            refs = self._refs[block_id]
            assert refs > 0, f"double free of block {block_id}"
            self._refs[block_id] = refs - 1
            if refs == 1:
                self._free[block_id] = None

    # -- prefix cache ------------------------------------------------------------------------

    def lookup(self, hashes: list[BlockHash]) -> list[int]:
        """The cached blocks of the longest registered prefix of the chain ``hashes``, each
        with a new reference taken."""
        if not self.caching:
            return []
        block_ids = []
        for block_hash in hashes:
            block_id = self._cached.get(block_hash)
            if block_id is None:
                break
            if self._refs[block_id] == 0:
                del self._free[block_id]
            self._refs[block_id] += 1
            block_ids.append(block_id)
        return block_ids

    def register(self, block_id: int, block_hash: BlockHash) -> None:
        """Record that ``block_id`` (held, computed, full) holds the block named
        ``block_hash``. A block already cached under that hash keeps the name; so does a
        block that already has one."""
        if not self.caching or self._hash_of[block_id] is not None:
            return
        if block_hash in self._cached:
            return
        assert self._refs[block_id] > 0, f"registering free block {block_id}"
        self._hash_of[block_id] = block_hash
        self._cached[block_hash] = block_id

    def ref_count(self, block_id: int) -> int:
        return self._refs[block_id]

    def check(self) -> None:
        """Invariants: a block is on the free queue exactly when nothing references it; the
        cache map and the blocks' names agree."""
        for block_id, refs in enumerate(self._refs):
            assert refs >= 0
            assert (refs == 0) == (block_id in self._free), f"block {block_id}: refs {refs}"
        for block_hash, block_id in self._cached.items():
            assert self._hash_of[block_id] == block_hash
        assert sum(h is not None for h in self._hash_of) == len(self._cached)

"""KV cache blocks: a free list and reference counts, in pure Python.

A block holds ``block_size`` consecutive token positions of one sequence. Blocks are shared
(reference count > 1) when the ``n`` samples of one request reuse the prompt's full blocks.
Verbs come in pairs: ``can_allocate`` / ``allocate``, ``share`` / ``free``.
"""

from __future__ import annotations

from collections import deque


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._refs = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` positions."""
        return -(-num_tokens // self.block_size)

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free)

    def allocate(self, num_blocks: int) -> list[int]:
        if num_blocks > len(self._free):
            raise RuntimeError(f"out of KV blocks: want {num_blocks}, {len(self._free)} free")
        block_ids = [self._free.popleft() for _ in range(num_blocks)]
        for block_id in block_ids:
            self._refs[block_id] = 1
        return block_ids

    def share(self, block_ids: list[int]) -> list[int]:
        """Take another reference on blocks some sequence already holds."""
        for block_id in block_ids:
            assert self._refs[block_id] > 0, f"sharing free block {block_id}"
            self._refs[block_id] += 1
        return list(block_ids)

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference on each block; a block with none left returns to the free list."""
        for block_id in block_ids:
            refs = self._refs[block_id]
            assert refs > 0, f"double free of block {block_id}"
            self._refs[block_id] = refs - 1
            if refs == 1:
                self._free.append(block_id)

    def ref_count(self, block_id: int) -> int:
        return self._refs[block_id]

    def check(self) -> None:
        """Invariant: a block is on the free list exactly when nothing references it."""
        free = set(self._free)
        assert len(free) == len(self._free), "a block is on the free list twice"
        for block_id, refs in enumerate(self._refs):
            assert refs >= 0
            assert (refs == 0) == (block_id in free), f"block {block_id}: refs {refs}"

"""The paged KV cache tensors and their sizing.

Layout, one tensor per layer (views into a single allocation)::

    kv[layer] : [2, num_kv_heads, num_blocks, block_size, head_dim]
                 ^ 0 = keys, 1 = values

Token ``pos`` of a sequence lives in block ``block_table[slot, pos // block_size]`` at
offset ``pos % block_size``; flattening ``num_blocks x block_size`` gives its row
``block * block_size + offset`` (the slot mapping), the same row in every head.

Heads come before blocks (DESIGN.md first had ``[2, num_blocks, block_size, kv_heads,
head_dim]``): attention gathers a batch's blocks with one ``index_select`` into
``[kv_heads, seqs, context, head_dim]``, already the layout SDPA wants. Block-major
storage needs a second, strided copy to move heads in front of the context, which made
decode attention 2-3x slower on the CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mpengine.config import EngineConfig, GiB

DEFAULT_CPU_BYTES = GiB


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    """The shape of one token's keys and values across all layers."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @property
    def bytes_per_block(self) -> int:
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * itemsize


def num_blocks_for(config: EngineConfig, spec: KVCacheSpec, device: torch.device) -> int:
    """How many blocks the cache gets: the override, else ``kv_cache_bytes`` over the block
    size. A GPU's cache is sized from a profiled forward instead (``gpu_memory``)."""
    if config.num_gpu_blocks_override is not None:
        return config.num_gpu_blocks_override
    if device.type == "cuda":
        raise ValueError("a GPU's KV cache is sized by gpu_memory.profiled_num_blocks")
    budget = config.kv_cache_bytes if config.kv_cache_bytes is not None else DEFAULT_CPU_BYTES
    return blocks_in(budget, spec)


def blocks_in(budget: int, spec: KVCacheSpec) -> int:
    """Whole blocks in ``budget`` bytes (at least one, or a clear error)."""
    num_blocks = budget // spec.bytes_per_block
    if num_blocks < 1:
        raise ValueError(
            f"KV cache budget of {budget} bytes holds no block of {spec.bytes_per_block} bytes"
        )
    return num_blocks


def allocate_kv_cache(
    spec: KVCacheSpec, num_blocks: int, device: torch.device
) -> list[torch.Tensor]:
    """Zero-filled per-layer KV tensors.

    Zeros, not ``empty``: attention reads whole blocks and masks the tail, and a masked
    value still enters ``softmax(...) @ V`` as ``0 * v``, which is NaN for a NaN ``v``.
    """
    storage = torch.zeros(
        (spec.num_layers, 2, spec.num_kv_heads, num_blocks, spec.block_size, spec.head_dim),
        dtype=spec.dtype,
        device=device,
    )
    return list(storage.unbind(0))

"""The paged KV cache tensors (how many blocks they hold is decided in ``kv_sizing``).

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

import contextlib
import logging
import math
import mmap
from dataclasses import dataclass

import numpy as np
import torch

from mpengine.config import GiB, MiB, cgroups

logger = logging.getLogger(__name__)


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


def blocks_in(budget: int, spec: KVCacheSpec) -> int:
    """Whole blocks in ``budget`` bytes (at least one, or a clear error)."""
    num_blocks = budget // spec.bytes_per_block
    if num_blocks < 1:
        raise ValueError(
            f"KV cache budget of {budget} bytes holds no block of {spec.bytes_per_block} bytes"
        )
    return num_blocks


def allocate_kv_cache(spec: KVCacheSpec, num_blocks: int, device: torch.device) -> torch.Tensor:
    """The zero-filled KV cache of all layers, ``[layers, 2, kv_heads, blocks, block_size,
    head_dim]`` (``unbind(0)`` gives the per-layer tensors).

    Zeros, not ``empty``: attention reads whole blocks and masks the tail, and a masked
    value still enters ``softmax(...) @ V`` as ``0 * v``, which is NaN for a NaN ``v``. For
    the same reason a block is zeroed again when it is reused (``clear_blocks``).
    """
    shape = (spec.num_layers, 2, spec.num_kv_heads, num_blocks, spec.block_size, spec.head_dim)
    if device.type == "cpu":
        _warn_past_available_memory(num_blocks * spec.bytes_per_block)
    try:
        if device.type == "cpu":
            storage = _huge_page_zeros(shape, spec.dtype)
        else:
            storage = torch.zeros(shape, dtype=spec.dtype, device=device)
    except (OSError, RuntimeError, OverflowError) as exc:  # mmap's ENOMEM, torch's OOM
        raise MemoryError(
            f"cannot allocate a KV cache of {num_blocks} blocks "
            f"({num_blocks * spec.bytes_per_block} bytes) on {device}: {exc}; lower "
            "kv_cache_bytes, num_gpu_blocks_override or gpu_memory_utilization"
        ) from None
    return storage


def available_memory() -> int | None:
    """Bytes this process could still fill: the kernel's ``MemAvailable``, less under a
    cgroup v2 memory limit (``memory.max`` less ``memory.current``); None if unknown."""
    available = None
    with contextlib.suppress(OSError, ValueError, StopIteration):
        with open("/proc/meminfo") as f:
            line = next(line for line in f if line.startswith("MemAvailable:"))
        available = int(line.split()[1]) * 1024
    with contextlib.suppress(OSError, ValueError, StopIteration):
        path = next(path for controllers, path in cgroups() if not controllers)
        group = f"/sys/fs/cgroup/{path.lstrip('/')}"
        with open(f"{group}/memory.max") as f:
            limit = f.read().strip()
        if limit != "max":
            with open(f"{group}/memory.current") as f:
                left = int(limit) - int(f.read())
            available = left if available is None else min(available, left)
    return available


def _warn_past_available_memory(size: int) -> None:
    """The CPU cache's pages are taken as it fills: one larger than the memory left starts,
    and the executor is killed for lack of memory once it fills, mid-serving."""
    available = available_memory()
    if available is not None and size > available:
        logger.warning(
            "the KV cache (%.1f GiB) is larger than the memory available (%.1f GiB): the "
            "executor may be killed for lack of memory once it fills; lower kv_cache_bytes",
            size / GiB,
            available / GiB,
        )


def clear_blocks(storage: torch.Tensor, blocks: torch.Tensor) -> None:
    """Zero ``blocks`` (int64, on the cache's device) in every layer. A step calls it for
    the blocks whose first row it writes: a block back from the free pool still holds its
    last owner's rows, which the new owner's attention reads (masked) until it fills them,
    and one non-finite value among them made the new owner's output NaN."""
    if len(blocks):
        storage.index_fill_(3, blocks, 0)


HUGE_PAGE = 2 * MiB


def _huge_page_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero-filled host tensor on fresh anonymous pages, huge where the kernel allows.

    Attention reads a few blocks of each sequence from all over the cache: with 4 KiB pages
    nearly every block read is a TLB miss. With 2 MiB pages the native decode attention of
    64 sequences over a 1 GiB cache ran 1.6x faster (871 -> 540 us per layer, one thread;
    as fast as over a cache of a few MiB). Linux maps them on request (``madvise``) in its
    default THP mode; elsewhere, or if refused, the pages stay small. The mapping's pages are
    zero when first touched, so the cache costs no time at start and no memory until its
    blocks are used (``torch.zeros`` wrote all of it).
    """
    itemsize = torch.empty((), dtype=dtype).element_size()
    nbytes = math.prod(shape) * itemsize
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buffer = torch.frombuffer(region, dtype=torch.uint8)  # keeps the mapping alive
    start = -buffer.data_ptr() % HUGE_PAGE
    if hasattr(mmap, "MADV_HUGEPAGE"):
        with contextlib.suppress(OSError):
            region.madvise(mmap.MADV_HUGEPAGE, start, nbytes - nbytes % HUGE_PAGE or HUGE_PAGE)
    return buffer[start : start + nbytes].view(dtype).view(shape)


def allocate_swap_space(spec: KVCacheSpec, num_blocks: int, device: torch.device) -> torch.Tensor:
    """Host memory for swapped-out blocks, one tensor in the device cache's layout with the
    layer first: ``[layers, 2, kv_heads, num_blocks, block_size, head_dim]``. Pinned when
    the cache is on a GPU (asynchronous copies); on the CPU its pages are mapped as blocks
    are first written."""
    try:
        return torch.empty(
            (spec.num_layers, 2, spec.num_kv_heads, num_blocks, spec.block_size, spec.head_dim),
            dtype=spec.dtype,
            pin_memory=device.type == "cuda",
        )
    except (RuntimeError, OverflowError) as exc:
        raise MemoryError(
            f"cannot allocate a swap space of {num_blocks} blocks "
            f"({num_blocks * spec.bytes_per_block} bytes): {exc}; lower swap_space"
        ) from None


class Swapper:
    """Copies blocks between the device KV cache and the swap space, for all layers at
    once: out (device -> host) before in (host -> device), before the step's forward.
    On a GPU the copies are queued on the compute stream, so the forward that reuses a
    block is ordered after them."""

    def __init__(self, caches: list[torch.Tensor], host: torch.Tensor, num_blocks: int) -> None:
        self.caches = caches
        self.host = host
        self.num_blocks = num_blocks
        self.device = caches[0].device if caches else torch.device("cpu")

    def _pairs(self, flat: np.ndarray, host_first: bool) -> tuple[torch.Tensor, torch.Tensor]:
        pairs = flat.reshape(-1, 2).astype(np.int64)
        host, device = (pairs[:, 0], pairs[:, 1]) if host_first else (pairs[:, 1], pairs[:, 0])
        if len(pairs) and (
            device.min() < 0
            or device.max() >= self.num_blocks
            or host.min() < 0
            or host.max() >= self.host.shape[3]
        ):
            raise ValueError("a swap names a block out of range")
        return torch.from_numpy(host), torch.from_numpy(device)

    def swap_out(self, flat: np.ndarray) -> None:
        host, device = self._pairs(flat, host_first=False)
        device = device.to(self.device)
        for layer, cache in enumerate(self.caches):
            blocks = cache.index_select(2, device)
            self.host[layer].index_copy_(2, host, blocks.to("cpu"))

    def swap_in(self, flat: np.ndarray) -> None:
        host, device = self._pairs(flat, host_first=True)
        device = device.to(self.device)
        for layer, cache in enumerate(self.caches):
            blocks = self.host[layer].index_select(2, host)
            cache.index_copy_(2, device, blocks.to(self.device))

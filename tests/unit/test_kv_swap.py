"""Swap space: blocks copied out to host memory and back, for every layer."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mpengine.executor.kv_cache import KVCacheSpec, Swapper, allocate_kv_cache, allocate_swap_space


def test_blocks_round_trip_through_the_swap_space():
    spec = KVCacheSpec(num_layers=3, num_kv_heads=2, head_dim=4, block_size=2, dtype=torch.float32)
    caches = list(allocate_kv_cache(spec, 6, torch.device("cpu")).unbind(0))
    for cache in caches:
        cache.copy_(torch.randn_like(cache))
    before = [cache.clone() for cache in caches]
    swapper = Swapper(caches, allocate_swap_space(spec, 4, torch.device("cpu")), num_blocks=6)
    swapper.swap_out(np.array([1, 3, 4, 0], np.int32))  # device 1 -> host 3, 4 -> 0
    for cache in caches:
        cache[:, :, [1, 4]] = 0.0  # the blocks serve someone else meanwhile
    swapper.swap_in(np.array([3, 5, 0, 2], np.int32))  # host 3 -> device 5, 0 -> 2
    for cache, old in zip(caches, before, strict=True):
        torch.testing.assert_close(cache[:, :, 5], old[:, :, 1])
        torch.testing.assert_close(cache[:, :, 2], old[:, :, 4])
        torch.testing.assert_close(cache[:, :, [0, 3]], old[:, :, [0, 3]])
    with pytest.raises(ValueError, match="out of range"):
        swapper.swap_in(np.array([4, 0], np.int32))  # host block 4 of 4
    with pytest.raises(ValueError, match="out of range"):
        swapper.swap_out(np.array([6, 0], np.int32))  # device block 6 of 6

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


def test_a_cpu_cache_past_the_memory_left_is_warned_about(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The CPU cache's pages are taken as it fills: one larger than the memory left (or a
    container's limit) started silently, and the executor would be killed mid-serving."""
    from mpengine.executor import kv_cache

    spec = kv_cache.KVCacheSpec(
        num_layers=1, num_kv_heads=1, head_dim=8, block_size=4, dtype=torch.float32
    )
    monkeypatch.setattr(kv_cache, "available_memory", lambda: 1000)
    with caplog.at_level("WARNING", logger="mpengine.executor.kv_cache"):
        kv_cache.allocate_kv_cache(spec, 64, torch.device("cpu"))  # 16 KiB
    assert "larger than the memory available" in caplog.text
    caplog.clear()
    monkeypatch.setattr(kv_cache, "available_memory", lambda: 1 << 30)
    with caplog.at_level("WARNING", logger="mpengine.executor.kv_cache"):
        kv_cache.allocate_kv_cache(spec, 64, torch.device("cpu"))
    assert "memory available" not in caplog.text

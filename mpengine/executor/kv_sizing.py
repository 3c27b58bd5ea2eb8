"""How many KV blocks the cache and its swap space get, and the longest sequence they
allow: the one place that decides.

Device blocks, the first rule that applies:

* an encoder keeps no cache (it computes whole prompts every step): none;
* ``num_gpu_blocks_override``, on any device;
* on a GPU, this engine's share of the device less what a profiled step needs, measured
  after the weights load (``gpu_memory``; :func:`gpu_memory_start` notes the device's
  memory before they do);
* on the CPU, ``kv_cache_bytes`` (1 GiB by default) in whole blocks (split between
  tensor-parallel ranks, each holding its share of the heads).

Swap space (``preemption_mode`` swap): ``swap_space`` bytes in whole blocks. A cache that
holds fewer tokens than ``max_model_len`` lowers it to what it holds (a longer sequence
could never run), or is an error if the user set ``max_model_len``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from mpengine.config import EngineConfig, GiB
from mpengine.executor.attention import Backend
from mpengine.executor.gpu_memory import MemoryStart, profiled_num_blocks
from mpengine.executor.kv_cache import KVCacheSpec, blocks_in
from mpengine.executor.model_loader import LoadedModel, resolve_device

logger = logging.getLogger(__name__)

DEFAULT_CPU_BYTES = GiB


@dataclass(frozen=True, slots=True)
class KVCacheSize:
    """The cache's blocks, the swap space's, and the longest sequence they allow."""

    spec: KVCacheSpec
    num_blocks: int  # on the device; 0: no cache (an encoder)
    num_host_blocks: int  # swap space; 0: no swapping
    max_model_len: int

    @property
    def num_bytes(self) -> int:
        return self.num_blocks * self.spec.bytes_per_block


def gpu_memory_start(config: EngineConfig) -> MemoryStart | None:
    """On a GPU whose KV cache is sized by ``gpu_memory_utilization``: the device's memory
    before this process loads anything (see ``gpu_memory``)."""
    device = resolve_device(config.device)
    if config.num_gpu_blocks_override is not None or device.type != "cuda":
        return None
    return MemoryStart.take(device)


def kv_cache_spec(loaded: LoadedModel, block_size: int) -> KVCacheSpec:
    """One block of the loaded model's keys and values, across its layers."""
    return KVCacheSpec(
        num_layers=loaded.num_layers,
        num_kv_heads=loaded.num_kv_heads,
        head_dim=loaded.head_dim,
        block_size=block_size,
        dtype=loaded.dtype,
    )


def size_kv_cache(
    config: EngineConfig,
    loaded: LoadedModel,
    spec: KVCacheSpec,
    backend: Backend,
    memory: MemoryStart | None,
) -> KVCacheSize:
    """The cache of ``spec`` blocks for ``loaded`` (see the module doc); ``backend`` runs
    the profiled step on a GPU, whose ``memory`` before loading is the one taken by
    :func:`gpu_memory_start`."""
    if loaded.is_encoder:
        num_blocks = 0
    elif config.num_gpu_blocks_override is not None:
        num_blocks = config.num_gpu_blocks_override
    elif loaded.device.type == "cuda":
        assert memory is not None
        num_blocks = profiled_num_blocks(config, spec, loaded, backend, memory)
    else:
        budget = config.kv_cache_bytes if config.kv_cache_bytes is not None else DEFAULT_CPU_BYTES
        # the engine's bytes: each tensor-parallel rank holds its heads' share of them
        num_blocks = blocks_in(budget // config.tensor_parallel_size, spec)
    return KVCacheSize(
        spec=spec,
        num_blocks=num_blocks,
        num_host_blocks=_num_host_blocks(config, spec, num_blocks),
        max_model_len=_max_model_len(config, loaded.max_model_len, num_blocks),
    )


def _num_host_blocks(config: EngineConfig, spec: KVCacheSpec, num_blocks: int) -> int:
    if config.preemption_mode != "swap" or not num_blocks:
        return 0
    num_host_blocks = config.swap_space // spec.bytes_per_block
    if num_host_blocks == 0:  # (vLLM's --swap-space 4 means GiB; here, bytes)
        raise ValueError(
            f"swap_space ({config.swap_space} bytes) holds no KV block of "
            f"{spec.bytes_per_block} bytes: give it in bytes or with a unit "
            "(--swap-space 4GiB), or use preemption_mode recompute"
        )
    return num_host_blocks


def _max_model_len(config: EngineConfig, model_len: int, num_blocks: int) -> int:
    """``model_len``, or what ``num_blocks`` hold if that is less."""
    capacity = num_blocks * config.block_size
    if not num_blocks or capacity >= model_len:
        return model_len
    if config.max_model_len is not None:  # the user's own: not changed behind them
        raise ValueError(
            f"max_model_len {config.max_model_len} is larger than the KV cache holds "
            f"({capacity} tokens, {num_blocks} blocks of {config.block_size}): "
            "give the cache more memory (kv_cache_bytes, gpu_memory_utilization, "
            "num_gpu_blocks_override) or lower max_model_len"
        )
    # A sequence longer than the whole cache could never run: requests asking for one (no
    # max_tokens given means "up to max_model_len") were refused.
    logger.warning(
        "the KV cache holds %d tokens (%d blocks of %d): max_model_len lowered from %d "
        "to %d; give the cache more memory (kv_cache_bytes, gpu_memory_utilization) "
        "for longer sequences",
        capacity,
        num_blocks,
        config.block_size,
        model_len,
        capacity,
    )
    return capacity

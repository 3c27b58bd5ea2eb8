"""Tensor parallelism: one model split over ``tensor_parallel_size`` executor processes.

transformers shards an unmodified model itself: ``from_pretrained(...,
distributed_config=DistributedConfig(tp_size=N))`` applies the model's
``base_model_tp_plan`` (attention and MLP projections split by column then by row, an
all-reduce after each row split; the head split by column and gathered), so the paged
attention function sees plain tensors holding this rank's heads, and the KV cache of each
rank holds ``num_kv_heads / N`` heads. Every rank runs the same plan on the same state
(``Executor``, fed the plans by rank 0 through a broadcast ring); the engine itself adds
two collectives, both here:

* at start, the block count and longest sequence agreed (the minimum over the ranks);
* every step that samples, the ids drawn by rank 0 sent to the others (a broadcast of
  one int64 per sampled row, -1 for a row whose sampling failed), since every rank needs
  them as its slots' last tokens at async depth 1. Rank 0 alone samples, fills grammar
  masks and computes logprobs; only its results leave the executor.

A step that fails before the forward fails alike on every rank (the same checks of the
same plan on the same state); a failure inside a collective, or a rank that died, ends
the rank (:class:`LostRank`), and with it the engine.

Each rank creates its process group itself (``init_method`` from the launcher: a free
loopback port) with a timeout fit for serving, rather than transformers' two hours: NCCL
with one device per rank on CUDA, gloo on the CPU, where the cores are split between the
ranks (``EngineConfig.max_threads``).
"""

from __future__ import annotations

import datetime
import logging
import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from transformers import PretrainedConfig

logger = logging.getLogger(__name__)


class LostRank(RuntimeError):
    """A collective failed (a rank died, or its forward raised): the ranks can no longer
    agree, so the executor stops and the engine with it."""


def check_plan(
    hf_config: PretrainedConfig,
    kind: str,
    size: int,
    device: torch.device,
    per_host: int | None = None,
) -> None:
    """Refuse, before anything loads, a model that ``size`` ranks (``per_host`` of them on
    this host, default all) cannot split: one line naming the reason."""
    per_host = per_host or size
    text_config = hf_config.get_text_config()
    model_type = getattr(text_config, "model_type", type(text_config).__name__)
    if kind != "causal":
        raise ValueError(
            f"tensor_parallel_size {size}: {model_type} is an embedding model; tensor "
            "parallelism splits decoders that generate (serve embeddings with "
            "tensor_parallel_size 1, or more engines)"
        )
    if not getattr(text_config, "base_model_tp_plan", None):
        raise ValueError(
            f"tensor_parallel_size {size}: {model_type} models have no tensor-parallel plan "
            "in transformers (base_model_tp_plan); serve this one with tensor_parallel_size 1"
        )
    heads = text_config.num_attention_heads
    kv_heads = getattr(text_config, "num_key_value_heads", None) or heads
    if heads % size or kv_heads % size:
        raise ValueError(
            f"tensor_parallel_size {size} must divide the model's query heads ({heads}) and "
            f"KV heads ({kv_heads})"
        )
    if device.type == "cuda" and per_host > torch.cuda.device_count():
        raise ValueError(
            f"tensor_parallel_size {size} needs a GPU per rank ({per_host} on this host); "
            f"torch sees {torch.cuda.device_count()}"
        )


class RankGroup:
    """This process's place among the ranks, and the engine's collectives between them."""

    def __init__(
        self,
        rank: int,
        size: int,
        local_rank: int,
        device: torch.device,
        init_method: str,
        timeout_s: float,
    ) -> None:
        self.rank, self.size = rank, size
        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":  # a GPU per rank of the host
            torch.cuda.set_device(local_rank)
            self.device = torch.device("cuda", local_rank)
        else:
            self.device = device
        # What transformers reads to find its rank (it joins the group created here).
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(size), LOCAL_RANK=str(local_rank))
        dist.init_process_group(
            backend,
            init_method=init_method,
            rank=rank,
            world_size=size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        # Small host-side agreements go over gloo on either device.
        self.control = dist.new_group(backend="gloo") if backend == "nccl" else dist.group.WORLD
        # Time in collectives (the step breakdown): the engine's own, and the model's
        # all-reduces (transformers calls ``dist.all_reduce`` after each row split; on the
        # CPU it returns when done, on CUDA when launched).
        self.collective_s = 0.0
        dist.all_reduce = self._timed(dist.all_reduce)
        self._broadcast = self._timed(dist.broadcast)
        logger.info("rank %d of %d joined (%s)", rank, size, backend)

    def _timed(self, collective: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return collective(*args, **kwargs)
            finally:
                self.collective_s += time.perf_counter() - started

        return timed

    @property
    def driver(self) -> bool:
        """Rank 0: the one that samples and whose results leave the executor."""
        return self.rank == 0

    def agree_min(self, value: int) -> int:
        """The smallest ``value`` over the ranks."""
        tensor = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=self.control)
        return int(tensor.item())

    def share_ids(self, ids: np.ndarray | None, count: int) -> np.ndarray:
        """Rank 0's sampled ids (``ids``, int64, ``count`` of them) on every rank."""
        if ids is None:
            tensor = torch.empty(count, dtype=torch.int64, device=self.device)
        else:
            tensor = torch.from_numpy(np.ascontiguousarray(ids, np.int64)).to(self.device)
        try:
            self._broadcast(tensor, src=0)
        except Exception as exc:
            raise LostRank(f"rank {self.rank}: sharing the sampled ids failed: {exc}") from exc
        return tensor.cpu().numpy()

    def gather(self, data: bytes) -> list[bytes]:
        """Every rank's ``data`` on rank 0, in rank order (the others get ``[]``)."""
        gathered: list[object] | None = [None] * self.size if self.driver else None
        try:
            dist.gather_object(data, gathered, dst=0, group=self.control)
        except Exception as exc:
            raise LostRank(f"rank {self.rank}: a gather failed: {exc}") from exc
        return [item for item in gathered or () if isinstance(item, bytes)]

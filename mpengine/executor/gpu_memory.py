"""GPU memory sizing: ``gpu_memory_utilization`` is the share of the device's *total* memory
this engine may use, weights, activations and KV cache together (what vLLM users expect).

1. Before the model loads, :meth:`MemoryStart.take` notes the device's free memory (the
   CUDA context exists by then and is not counted: a few hundred MiB per process).
2. After the weights load, a profiling forward at ``max_num_batched_tokens`` tokens and a
   sampling of ``max_num_seqs`` rows (top-k, top-p, logprobs: its largest temporaries)
   give the peak of torch's allocations, weights included.
3. KV cache = ``total * utilization`` - that peak - what this process took outside
   torch's allocator since step 1 (cuBLAS workspaces, loaded kernels) - an estimate of the
   CUDA graphs' memory pool (:func:`graph_pool_estimate`).

Each engine's share is fixed by the total, not by "the memory free when I looked". A start
that finds less free memory than its share needs fails with a message that says so, instead
of running out of memory later. Not yet measured on a device, and known to be short:
- each process's CUDA context (a few hundred MiB) and what an idle device already uses lie
  outside every share, so shares that add up to exactly 1 do not all fit (keep their sum a
  little under 1);
- step 3's "outside torch" is the change in the device's free memory, so another engine
  loading meanwhile is counted as this one's (start engines one after another);
- a step with prompt logprobs keeps a logits row per scored token (its float32 work runs
  256 rows at a time), which the profile does not.
Per-process figures from NVML would fix the first two.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import numpy as np
import torch

from mpengine.config import EngineConfig, GiB
from mpengine.executor.attention import METADATA_KWARG, Backend, StepLayout
from mpengine.executor.kv_cache import KVCacheSpec, allocate_kv_cache, blocks_in
from mpengine.executor.model_loader import LoadedModel
from mpengine.executor.paged_attention import build_metadata
from mpengine.executor.sampler import Sampler, SamplingRows

logger = logging.getLogger(__name__)

PROFILE_LOGPROBS = 20  # top logprobs asked for by every row of the profiled sampling


@dataclass(frozen=True, slots=True)
class MemoryStart:
    """The device's memory before this process allocated anything on it."""

    free: int
    total: int

    @classmethod
    def take(cls, device: torch.device) -> MemoryStart:
        """Of ``device`` (``cuda:1`` read the current device, ``cuda:0``, and made a
        context there)."""
        if device.index is not None:  # (plain "cuda" is the current device)
            torch.cuda.set_device(device)
        torch.cuda.init()
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(device)
        return cls(free=free, total=total)


def kv_cache_budget(
    total: int, utilization: float, torch_peak: int, non_torch: int, graph_pool: int
) -> int:
    """Bytes left for the KV cache of an engine allowed ``utilization`` of ``total``."""
    return int(total * utilization) - torch_peak - non_torch - graph_pool


def graph_pool_estimate(
    activation_peak: int, profiled_tokens: int, sizes: list[int], logits_row_bytes: int
) -> int:
    """What the captured decode graphs keep: activations of the largest graph batch (scaled
    from the profiled forward's) and the logits of every captured batch size (each graph
    keeps its own output rows), for the captured batch ``sizes``."""
    share = min(1.0, max(sizes) / max(profiled_tokens, 1))
    return int(activation_peak * share) + sum(sizes) * logits_row_bytes


def profiled_num_blocks(
    config: EngineConfig,
    spec: KVCacheSpec,
    loaded: LoadedModel,
    backend: Backend,
    start: MemoryStart,
) -> int:
    """The number of KV blocks for this engine's share of the GPU (see the module doc)."""
    device = loaded.device
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    weights = torch.cuda.memory_allocated(device)
    with torch.inference_mode():
        profile_forward(loaded, spec, backend, config.max_num_batched_tokens, config.max_num_seqs)
        if loaded.can_generate:  # an embedding model samples nothing
            profile_sampler(loaded, config.max_num_seqs, config.seed)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    free, total = torch.cuda.mem_get_info(device)
    non_torch = max(0, (start.free - free) - torch.cuda.memory_reserved(device))
    torch.cuda.empty_cache()
    activations = peak - weights
    graphs = 0
    if not config.enforce_eager and backend == "triton" and loaded.can_generate:
        from mpengine.executor.cuda_graphs import graph_batch_sizes, max_graph_batch

        row_bytes = loaded.vocab_size * torch.empty((), dtype=loaded.dtype).element_size()
        sizes = graph_batch_sizes(max_graph_batch(config))
        graphs = graph_pool_estimate(activations, config.max_num_batched_tokens, sizes, row_bytes)
    budget = kv_cache_budget(total, config.gpu_memory_utilization, peak, non_torch, graphs)
    logger.info(
        "GPU memory: total %.2f GiB x %.2f; weights %.2f GiB, activations %.2f GiB, outside "
        "torch %.2f GiB, CUDA graphs ~%.2f GiB -> KV cache %.2f GiB",
        total / GiB,
        config.gpu_memory_utilization,
        weights / GiB,
        activations / GiB,
        non_torch / GiB,
        graphs / GiB,
        budget / GiB,
    )
    if budget <= 0:
        raise ValueError(
            f"gpu_memory_utilization {config.gpu_memory_utilization} of {total / GiB:.2f} GiB "
            f"leaves nothing for the KV cache after weights and activations "
            f"({peak / GiB:.2f} GiB): raise it, or lower max_num_batched_tokens"
        )
    free_now = torch.cuda.mem_get_info(device)[0]
    needed = budget + activations + graphs
    if needed > free_now:
        raise RuntimeError(
            f"this engine's share of the GPU (gpu_memory_utilization "
            f"{config.gpu_memory_utilization}) needs {needed / GiB:.2f} GiB more, but only "
            f"{free_now / GiB:.2f} GiB are free: other processes use the rest; lower "
            "gpu_memory_utilization"
        )
    return blocks_in(budget, spec)


def profile_forward(
    loaded: LoadedModel, spec: KVCacheSpec, backend: Backend, num_tokens: int, max_num_seqs: int
) -> torch.Tensor:
    """One forward over ``num_tokens`` prompt tokens (as few sequences as
    ``max_model_len`` allows) on a throwaway cache that just holds them; returns the logits
    of each sequence's last token (its hidden states, for a model without an LM head).
    Runs on any device (the tests run it on the CPU)."""
    device, bs = loaded.device, spec.block_size
    seq_len = min(num_tokens, loaded.max_model_len)
    num_seqs = min(math.ceil(num_tokens / seq_len), max(max_num_seqs, 1))
    lengths = np.full(num_seqs, seq_len, np.int64)
    lengths[-1] = min(seq_len, num_tokens - seq_len * (num_seqs - 1))
    blocks = -(-lengths // bs)
    caches = list(allocate_kv_cache(spec, int(blocks.sum()), device).unbind(0))
    width = int(blocks.max())
    first_block = np.cumsum(blocks) - blocks
    table = (first_block[:, None] + np.arange(width)[None, :]).astype(np.int32)
    table[np.arange(width)[None, :] >= blocks[:, None]] = -1
    starts = np.zeros(num_seqs, np.int64)
    first_token = np.cumsum(lengths) - lengths
    positions = np.arange(lengths.sum()) - np.repeat(first_token, lengths)
    # Each sequence's blocks are consecutive: token p of sequence i lands at row
    # first_block[i] * bs + p.
    slot_mapping = np.repeat(first_block * bs, lengths) + positions
    layout = StepLayout(starts=starts, num_tokens=lengths, block_table=table, block_size=bs)

    def to(array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array)).to(device)

    metadata = build_metadata(
        backend,
        layout,
        caches,
        to(slot_mapping.astype(np.int64)),
        to(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)),
        to(lengths),
        to(table),
    )
    last = to(first_token + lengths - 1)
    inputs = dict(
        input_ids=torch.zeros(1, int(lengths.sum()), dtype=torch.int64, device=device),
        position_ids=to(positions)[None],
        use_cache=False,
        **{METADATA_KWARG: metadata},
    )
    if not loaded.can_generate:  # a decoder without its head (embeddings): hidden states
        return loaded.model(**inputs).last_hidden_state[0].index_select(0, last)
    return loaded.model(**inputs, logits_to_keep=last).logits[0]


def profile_sampler(loaded: LoadedModel, num_rows: int, seed: int) -> None:
    """Sampling of ``num_rows`` rows with every restriction on: its temporaries (a sort of
    the logits, their probabilities, the penalties' counts over the vocabulary and each
    row's whole context) are the largest of any step's sampling."""
    logits = torch.zeros(num_rows, loaded.vocab_size, dtype=loaded.dtype, device=loaded.device)
    empty = np.zeros(0, np.int64)
    context = loaded.max_model_len
    rows = SamplingRows(
        temperature=np.ones(num_rows, np.float32),
        top_k=np.full(num_rows, 50, np.int64),
        top_p=np.full(num_rows, 0.9, np.float32),
        min_p=np.full(num_rows, 0.05, np.float32),
        repetition_penalty=np.full(num_rows, 1.1, np.float32),
        presence_penalty=np.full(num_rows, 0.1, np.float32),
        frequency_penalty=np.full(num_rows, 0.1, np.float32),
        seeded=np.zeros(num_rows, bool),
        draw_seeds=np.zeros(num_rows, np.int64),
        logprobs=np.full(num_rows, PROFILE_LOGPROBS, np.int32),
        penalty_rows=np.arange(num_rows, dtype=np.int64),
        penalty_tokens=np.zeros((num_rows, context), np.int64),
        penalty_is_output=np.ones((num_rows, context), bool),
        banned_rows=empty,
        banned_ids=empty,
    )
    Sampler(loaded.device, seed).sample(logits, rows)

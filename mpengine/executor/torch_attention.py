"""Paged attention with torch operations: the CPU backend and the reference.

Per layer: one ``index_copy_`` writes the step's keys and values into their cache rows
(the slot mapping), then at most two attention calls read them back, one per kind of
query, both planned once per step (:func:`plan_step`) from the same host layout:

* **decodes** (one query each): every decode of the step in one attention. Their blocks
  are gathered with one ``index_select`` (keys and values together) into
  ``[kv_heads, seqs, context, head_dim]``, padded to the longest decode context with an
  additive length mask; GQA is folded into the query axis, so keys are never repeated.
  With a single query row per (kv head, sequence) pair group, two batched matrix products
  and a softmax beat SDPA's flash kernel on the CPU, whose blocking is built for long
  queries (measured 1.3-2x for the whole decode attention with two threads). When the
  contexts are so uneven that padding would more than double the keys read (one long
  decode among many short ones), the step reads each sequence's own blocks instead, in
  chunks of a few blocks, and combines per-chunk partial softmaxes
  (:func:`_decode_chunked`): almost no padding, at ~1.2-1.4x the padded call's cost per
  key on the CPU.
* **prefill chunks** (several queries each): one SDPA call over the chunks padded to the
  longest chunk and context, with a causal mask offset by each chunk's start. A lone
  chunk at position 0 skips the cache read: it attends to its own new keys through SDPA's
  unmasked causal path (its fastest CPU kernel).

Padding decodes to a 600-token chunk would make a 63-decode + 1-chunk step pay for 64
chunks; splitting by kind keeps that cost at one extra call per layer.

Gathers select rows of the cache viewed as ``[2 * kv_heads * blocks, block_size *
head_dim]``, with the row ids of every head planned once per step: selecting along that
first axis is 1.5-2x faster than along the block axis of ``[2 * kv_heads, blocks, ...]``
(the gather is memory-bound; measured with two threads).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

import mpengine.executor.native_attention as native_attention
from mpengine.executor.attention import StepLayout
from mpengine.executor.native_attention import Kernels

# Padded decode attention reads N * longest keys; the chunked one reads each sequence's
# own blocks at ~1.2-1.4x the cost per key (measured on the CPU; tools/bench_executor.py's
# "uneven" column is the case it is for).
CHUNKED_PADDING_RATIO = 2.0
# Blocks per chunk of the chunked decode: larger chunks mean fewer, larger matrix products
# (8 blocks of 16 measured best), at the cost of padding each sequence's last chunk.
MAX_CHUNK_BLOCKS = 8


@dataclass(slots=True)
class DecodePlan:
    """Decodes attended together (one query each)."""

    rows: torch.Tensor | None  # [D] batch rows of the decodes; None: rows 0 .. D-1
    blocks: torch.Tensor  # cache rows (see _cache_rows) of [D * W] (padded) or [K * C] blocks
    # padded: [1, D, 1, W * bs] additive (0 = key, -inf = none);
    # chunked: [1, K, 1, C * bs] bool, True = key
    mask: torch.Tensor
    num_seqs: int
    seq_of_chunk: torch.Tensor | None  # [K] chunked only: the decode each chunk belongs to


@dataclass(slots=True)
class NativeDecodePlan:
    """Decodes for the native kernel, which reads their blocks in place."""

    rows: torch.Tensor | None  # [D] int64 batch rows of the decodes; None: rows 0 .. D-1
    block_table: torch.Tensor  # [D, W] int32, contiguous
    contexts: torch.Tensor  # [D] int64, keys of each decode


@dataclass(slots=True)
class PrefillPlan:
    """Chunks of several tokens, padded to ``[N, Q]`` queries over ``[N, W * bs]`` keys."""

    token_idx: torch.Tensor | None  # [N*Q] batch rows of the padded queries; None: in order
    blocks: torch.Tensor  # cache rows (see _cache_rows) of [N * W] blocks, sequence-major
    mask: torch.Tensor  # [N, 1, Q, W * bs] bool
    num_seqs: int
    num_queries: int  # Q, the longest chunk
    fresh: bool  # one chunk at position 0: attends to its own keys, no cache read
    out_rows: torch.Tensor | None  # real rows of the [N*Q] output (None: all)
    out_token_idx: torch.Tensor | None  # batch rows of those outputs (None: in order)


class Workspace:
    """A grow-only buffer the gathered keys and values are written into, reused by every
    layer and step. A fresh tensor of tens of MiB is dearer than the gather itself: its pages
    are faulted in on every use (measured 33 MiB: 314 ms fresh, 33 ms reused, on the 2-core
    build machine)."""

    def __init__(self) -> None:
        self.buffer = torch.empty(0)

    def take(self, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        size = math.prod(shape)
        buffer = self.buffer
        if buffer.numel() < size or buffer.dtype != like.dtype or buffer.device != like.device:
            self.buffer = buffer = torch.empty(size, dtype=like.dtype, device=like.device)
        return buffer[:size].view(shape)


@dataclass(slots=True)
class TorchPlan:
    decode: DecodePlan | NativeDecodePlan | None
    prefill: PrefillPlan | None
    workspace: Workspace | None = None  # None: every gather allocates
    native: Kernels | None = None  # the native backend: cache writes and decodes in C


def plan_step(
    layout: StepLayout,
    cache: torch.Tensor,
    workspace: Workspace | None = None,
    native: Kernels | None = None,
) -> TorchPlan:
    """Index tensors and masks of both kinds of queries, built once per step; ``cache`` is
    any layer's cache (they share shape, dtype and device). With ``native`` kernels (the
    native backend; the caller checked that they take this cache), decodes and cache
    writes run in C."""
    is_decode = layout.num_tokens == 1
    first_token = np.cumsum(layout.num_tokens) - layout.num_tokens
    decode: DecodePlan | NativeDecodePlan | None = None
    prefill = None
    if is_decode.any():
        members = np.flatnonzero(is_decode)
        if native is not None:
            decode = _plan_native_decodes(layout, members, first_token)
        else:
            decode = _plan_decodes(layout, members, first_token, cache)
    if not is_decode.all():
        members = np.flatnonzero(~is_decode)
        prefill = _plan_prefill(layout, members, first_token, cache)
    return TorchPlan(decode=decode, prefill=prefill, workspace=workspace, native=native)


def _cache_rows(blocks: np.ndarray, cache: torch.Tensor) -> np.ndarray:
    """Rows of the cache viewed as ``[2 * kv_heads * num_blocks, block_size * head_dim]``
    holding ``blocks``: keys of every head, then values of every head."""
    two, num_kv_heads, num_blocks = cache.shape[:3]
    heads = np.arange(two * num_kv_heads, dtype=np.int64)[:, None] * num_blocks
    return (heads + blocks.astype(np.int64)[None, :]).reshape(-1)


def _plan_decodes(
    layout: StepLayout, members: np.ndarray, first_token: np.ndarray, cache: torch.Tensor
) -> DecodePlan:
    device = cache.device
    bs = layout.block_size
    contexts = layout.starts[members] + 1
    num_blocks = -(-contexts // bs)
    width = int(num_blocks.max())
    rows = first_token[members]
    in_order = bool(len(members) == 0 or (rows == np.arange(len(rows))).all())
    table = layout.block_table[members, :width]
    if len(members) * width > CHUNKED_PADDING_RATIO * num_blocks.sum():
        blocks, mask, seq_of_chunk = _chunks(table, num_blocks, contexts, bs)
        return DecodePlan(
            rows=None if in_order else _to(rows, device),
            blocks=_to(_cache_rows(blocks, cache), device),
            mask=_to(mask[None, :, None, :], device),
            num_seqs=len(members),
            seq_of_chunk=_to(seq_of_chunk, device),
        )
    # Entries past a shorter context may be unset (-1): the mask hides what they read.
    blocks = _own_blocks(table).reshape(-1)
    keys = np.arange(width * bs)[None, :] < contexts[:, None]
    bias = np.where(keys, np.float32(0), np.float32(-np.inf))
    return DecodePlan(
        rows=None if in_order else _to(rows, device),
        blocks=_to(_cache_rows(blocks, cache), device),
        mask=_to(bias[None, :, None, :], device, cache.dtype),
        num_seqs=len(members),
        seq_of_chunk=None,
    )


def _own_blocks(table: np.ndarray) -> np.ndarray:
    """``table`` with its unset entries (-1) pointing at the row's first block. Padding reads
    must stay inside the sequence: masked scores do not keep NaN out (-inf + NaN and
    0 x NaN are NaN), so a block of another sequence's (block 0 for every unset entry) let
    that sequence's non-finite keys or values make this one's output NaN."""
    return np.where(table < 0, table[:, :1], table)


def _plan_native_decodes(
    layout: StepLayout, members: np.ndarray, first_token: np.ndarray
) -> NativeDecodePlan:
    rows = first_token[members]
    in_order = bool((rows == np.arange(len(rows))).all())
    contexts = layout.starts[members] + 1
    # At least two columns (the kernel reads only a context's own): a compiled forward
    # treats a size of 1 as a special case, and would compile again for it.
    width = max(int(-(-contexts.max() // layout.block_size)), 2)
    table = np.full((len(members), width), -1, dtype=np.int32)
    rows_table = layout.block_table[members, :width]
    table[:, : rows_table.shape[1]] = rows_table
    return NativeDecodePlan(
        rows=None if in_order else torch.from_numpy(rows.astype(np.int64)),
        block_table=torch.from_numpy(table),
        contexts=torch.from_numpy(contexts.astype(np.int64)),
    )


def _chunks(
    table: np.ndarray, num_blocks: np.ndarray, contexts: np.ndarray, block_size: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each sequence's blocks in chunks of ``C`` (the largest power of two up to
    :data:`MAX_CHUNK_BLOCKS` that pads the blocks read by at most a quarter): block ids
    ``[K * C]`` (padding: the sequence's first block), key mask ``[K, C * block_size]``,
    sequence of each chunk ``[K]``."""
    chunk = MAX_CHUNK_BLOCKS
    while chunk > 1 and (-(-num_blocks // chunk) * chunk).sum() > 1.25 * num_blocks.sum():
        chunk //= 2
    num_chunks = -(-num_blocks // chunk)
    seq_of_chunk = np.repeat(np.arange(len(num_blocks)), num_chunks)
    first_chunk = np.cumsum(num_chunks) - num_chunks
    index = np.arange(len(seq_of_chunk)) - np.repeat(first_chunk, num_chunks)
    block_index = index[:, None] * chunk + np.arange(chunk)[None, :]  # [K, C] in the row
    owned = block_index < num_blocks[seq_of_chunk, None]
    column = np.minimum(block_index, table.shape[1] - 1)
    blocks = np.where(owned, table[seq_of_chunk[:, None], column], -1)
    blocks = np.where(blocks < 0, table[seq_of_chunk, :1], blocks)  # (see _own_blocks)
    key_pos = block_index[:, :, None] * block_size + np.arange(block_size)
    mask = key_pos.reshape(len(seq_of_chunk), -1) < contexts[seq_of_chunk, None]
    return blocks.astype(np.int64).reshape(-1), mask, seq_of_chunk


def _plan_prefill(
    layout: StepLayout, members: np.ndarray, first_token: np.ndarray, cache: torch.Tensor
) -> PrefillPlan:
    device = cache.device
    bs = layout.block_size
    starts, n = layout.starts[members], layout.num_tokens[members]
    contexts = starts + n
    num_queries = int(n.max())
    width = -(-int(contexts.max()) // bs)
    table = _own_blocks(layout.block_table[members, :width])
    keys = np.arange(width * bs)
    query = np.arange(num_queries)
    # Query r of a chunk sits at position start + r and sees keys 0 ..= start + r.
    # Padded queries (r >= n) also get a non-empty row, so no softmax sees only -inf.
    query_pos = np.minimum(starts[:, None] + query, contexts[:, None] - 1)
    mask = keys[None, None, :] <= query_pos[:, :, None]
    real = query[None, :] < n[:, None]
    rows = first_token[members, None] + np.minimum(query[None, :], n[:, None] - 1)
    in_order = bool(rows[real][0] == 0 and (np.diff(rows[real]) == 1).all())
    single = len(n) == 1
    return PrefillPlan(
        token_idx=None if in_order and single else _to(rows.reshape(-1), device),
        blocks=_to(_cache_rows(table.reshape(-1), cache), device),
        mask=_to(mask[:, None], device),
        num_seqs=len(n),
        num_queries=num_queries,
        fresh=single and int(starts[0]) == 0,
        out_rows=None if real.all() else _to(np.flatnonzero(real), device),
        out_token_idx=None if in_order else _to(rows[real], device),
    )


def _to(array: np.ndarray, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    tensor = torch.from_numpy(np.ascontiguousarray(array))
    if dtype is not None:
        tensor = tensor.to(dtype)
    return tensor if device.type == "cpu" else tensor.to(device, non_blocking=True)


def attend(
    plan: TorchPlan,
    cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scaling: float | None,
) -> torch.Tensor:
    """One layer: ``query`` ``[1, heads, T, dim]``, ``key``/``value`` ``[1, kv_heads, T, dim]``
    (transformers' layout); returns ``[T, heads, dim]``."""
    num_kv_heads, head_dim = cache.shape[1], cache.shape[-1]
    group = query.shape[1] // num_kv_heads
    decoder = plan.native if isinstance(plan.decode, NativeDecodePlan) else None
    if decoder is not None and group > decoder.max_group:  # before anything is written
        raise NotImplementedError(
            f"{group} query heads per KV head: the native kernel takes at most "
            f"{decoder.max_group} (use the torch backend)"
        )
    # 1. this step's keys and values -> their cache rows (every head at the same row)
    if plan.native is not None:
        native_attention.store_kv(cache, slot_mapping, key[0], value[0])
    else:
        cache[0].view(num_kv_heads, -1, head_dim).index_copy_(1, slot_mapping, key[0])
        cache[1].view(num_kv_heads, -1, head_dim).index_copy_(1, slot_mapping, value[0])

    # 2. decodes and prefill chunks, each kind in one call
    queries = query[0].transpose(0, 1)  # [T, heads, head_dim]
    out: torch.Tensor | None = None
    parts: list[tuple[torch.Tensor | None, torch.Tensor]] = []
    if isinstance(plan.decode, NativeDecodePlan):
        # Written in place: each decode's row of the step's output.
        out = queries.new_empty(queries.shape[0], queries.shape[1], value.shape[-1])
        decode = plan.decode
        scale = head_dim**-0.5 if scaling is None else scaling
        native_attention.decode(
            out,
            queries,
            cache,
            decode.rows,
            decode.block_table,
            decode.contexts,
            scale,
        )
    elif plan.decode is not None:
        part = _decode(plan.decode, queries, cache, scaling, plan.workspace)
        parts.append((plan.decode.rows, part))
    if plan.prefill is not None:
        part = _prefill(plan.prefill, queries, cache, scaling, key, value, plan.workspace)
        parts.append((plan.prefill.out_token_idx, part))
    if out is None:
        if len(parts) == 1 and parts[0][0] is None:
            return parts[0][1]
        out = queries.new_empty(queries.shape[0], queries.shape[1], value.shape[-1])
    for rows, part in parts:
        if rows is None:
            out[: len(part)] = part
        else:
            out.index_copy_(0, rows, part)
    return out


def _gather(cache: torch.Tensor, rows: torch.Tensor, workspace: Workspace | None) -> torch.Tensor:
    """Keys and values of the blocks at cache ``rows`` (:func:`_cache_rows`):
    ``[2, kv_heads, blocks * block_size, head_dim]``, one ``index_select`` for both (the
    cache of a layer is contiguous), into ``workspace`` (valid until the next gather)."""
    two, num_kv_heads, num_blocks, block_size, head_dim = cache.shape
    flat = cache.view(two * num_kv_heads * num_blocks, block_size * head_dim)
    if workspace is None:
        out = flat.index_select(0, rows)
    else:
        shape = (len(rows), block_size * head_dim)
        out = torch.index_select(flat, 0, rows, out=workspace.take(shape, cache))
    return out.view(two, num_kv_heads, -1, head_dim)


def _decode(
    plan: DecodePlan,
    queries: torch.Tensor,
    cache: torch.Tensor,
    scaling: float | None,
    workspace: Workspace | None,
) -> torch.Tensor:
    """Returns ``[D, heads, head_dim]`` in decode order."""
    num_kv_heads, head_dim = cache.shape[1], cache.shape[-1]
    n = plan.num_seqs
    q = queries[:n] if plan.rows is None else queries.index_select(0, plan.rows)
    # Batch over (kv head, sequence); the query heads sharing a kv head form the query axis.
    q = q.reshape(n, num_kv_heads, -1, head_dim).transpose(0, 1)  # [kv, D, group, dim]
    if plan.seq_of_chunk is not None:
        out = _decode_chunked(plan, q, cache, scaling, workspace)
    else:
        kv = _gather(cache, plan.blocks, workspace)
        keys, values = kv.view(2, num_kv_heads, n, -1, head_dim)
        scale = head_dim**-0.5 if scaling is None else scaling
        # Scaled first: in float16, q.k of real models can pass 65504 before the scale.
        scores = torch.matmul(q * scale, keys.transpose(-1, -2)).add_(plan.mask)
        out = torch.matmul(torch.softmax(scores, dim=-1), values)  # [kv, D, group, dim]
    return out.transpose(0, 1).reshape(n, queries.shape[1], -1)


def _decode_chunked(
    plan: DecodePlan,
    q: torch.Tensor,
    cache: torch.Tensor,
    scaling: float | None,
    workspace: Workspace | None,
) -> torch.Tensor:
    """Decode attention over each sequence's own blocks, in chunks: per chunk a partial
    softmax (its maximum, sum and weighted values), then the chunks of a sequence combined
    with weights ``exp(chunk max - sequence max)`` (flash decoding)."""
    num_kv_heads, head_dim = cache.shape[1], cache.shape[-1]
    seq_of_chunk = plan.seq_of_chunk
    assert seq_of_chunk is not None
    scale = head_dim**-0.5 if scaling is None else scaling
    kv = _gather(cache, plan.blocks, workspace)
    keys, values = kv.view(2, num_kv_heads, len(seq_of_chunk), -1, head_dim)
    q_chunks = q.index_select(1, seq_of_chunk)  # [kv, K, group, dim]
    scores = torch.matmul(q_chunks * scale, keys.transpose(-1, -2))  # [kv, K, group, C*bs]
    scores.masked_fill_(~plan.mask, float("-inf"))
    chunk_max = scores.amax(dim=-1)  # [kv, K, group]; every chunk holds >= 1 key
    index = seq_of_chunk[None, :, None].expand_as(chunk_max)
    seq_max = chunk_max.new_full(q.shape[:3], float("-inf"))
    seq_max.scatter_reduce_(1, index, chunk_max, "amax")
    weights = torch.exp(scores - seq_max.index_select(1, seq_of_chunk)[..., None])
    total = chunk_max.new_zeros(q.shape[:3]).index_add_(1, seq_of_chunk, weights.sum(-1))
    out = q.new_zeros(q.shape).index_add_(1, seq_of_chunk, torch.matmul(weights, values))
    return out / total[..., None]


def _prefill(
    plan: PrefillPlan,
    queries: torch.Tensor,
    cache: torch.Tensor,
    scaling: float | None,
    key: torch.Tensor,
    value: torch.Tensor,
    workspace: Workspace | None,
) -> torch.Tensor:
    """Returns ``[real queries, heads, head_dim]`` in plan order."""
    num_kv_heads, head_dim = cache.shape[1], cache.shape[-1]
    n, q_len = plan.num_seqs, plan.num_queries
    num_heads = queries.shape[1]
    q = queries if plan.token_idx is None else queries.index_select(0, plan.token_idx)
    gqa = num_heads != num_kv_heads
    if plan.fresh:
        if plan.token_idx is not None:
            key = key.index_select(2, plan.token_idx)
            value = value.index_select(2, plan.token_idx)
        elif q.shape[0] != q_len:  # the chunk is a prefix of the batch: decodes follow it
            q, key, value = q[:q_len], key[:, :, :q_len], value[:, :, :q_len]
        q = q.reshape(1, q_len, num_heads, head_dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(
            q, key, value, is_causal=True, scale=scaling, enable_gqa=gqa
        )
        return out[0].transpose(0, 1)
    if q.shape[0] != n * q_len:  # one chunk, in order, that other rows follow
        q = q[: n * q_len]
    kv = _gather(cache, plan.blocks, workspace)
    keys, values = kv.view(2, num_kv_heads, n, -1, head_dim)
    q = q.reshape(n, q_len, num_heads, head_dim).transpose(1, 2)
    out = F.scaled_dot_product_attention(
        q,
        keys.transpose(0, 1),
        values.transpose(0, 1),
        attn_mask=plan.mask,
        scale=scaling,
        enable_gqa=gqa,
    )
    out = out.transpose(1, 2).reshape(n * q_len, num_heads, -1)
    return out if plan.out_rows is None else out.index_select(0, plan.out_rows)

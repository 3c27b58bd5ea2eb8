"""Paged attention as a transformers attention function.

The model runs one flattened batch: ``input_ids`` is ``[1, T]`` with every scheduled token
of every sequence, positions restarting per sequence. transformers hands the registered
function ``attention_mask=None`` for a custom implementation, so causality and sequence
boundaries are enforced here, from an :class:`AttentionMetadata` built once per step and
passed through the model's forward kwargs.

Per layer (``module.layer_idx``) the function

1. writes the step's keys and values into the layer's cache rows (the slot mapping), then
2. attends from each query to its sequence's whole context (cached and new tokens alike),
   read back from the cache block by block.

Step 2 runs as a few batched SDPA calls, one per group, never a loop over sequences:

* **decode groups**: sequences with one query token, bucketed by context length (powers
  of two in blocks above :data:`MIN_BUCKET_BLOCKS`, so padding at most doubles a
  context). Block lists are padded to the longest context of the bucket; a length mask
  hides the padding. GQA is folded into the query dimension
  (``[D, kv_heads, group, head_dim]``), so keys are never repeated.
* **prefill group**: chunks of several tokens, padded to the longest chunk and context,
  with a causal mask offset by each chunk's start. A lone chunk at position 0 skips the
  cache read: it attends to its own new keys with SDPA's unmasked causal path.

Padding every sequence to the longest chunk would make a 63-decode + 1-long-chunk step
pay for 64 long chunks, and one long decode would make 63 short ones read its length;
the grouping keeps padding small at a few extra kernel calls per layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from transformers import AttentionInterface

ATTENTION_NAME = "mpengine_paged"
METADATA_KWARG = "mpengine_attention"
# Decodes up to this many blocks share one group: below it, padding costs less than the
# extra kernel calls of another group.
MIN_BUCKET_BLOCKS = 32


@dataclass(slots=True)
class AttentionGroup:
    """Sequences attended together: queries gathered into ``[N, Q]``, contexts into
    ``[N, num_blocks * block_size]`` rows of the cache."""

    token_idx: torch.Tensor | None  # [N*Q] batch rows of the queries; None: all, in order
    blocks: torch.Tensor  # [N * num_blocks] block ids, sequence-major
    mask: torch.Tensor  # [N, 1, Q, L] bool, True = attend
    num_seqs: int
    num_queries: int  # Q: 1 for decodes, the longest chunk for prefills
    # One chunk starting at position 0: its whole context is this step's keys, so it
    # attends to them directly, causal without a mask (SDPA's fastest CPU path).
    fresh: bool
    out_rows: torch.Tensor | None  # real rows of the [N*Q] output (None: all)
    out_token_idx: torch.Tensor | None  # batch rows those outputs belong to


@dataclass(slots=True)
class AttentionMetadata:
    """Everything the attention layers need for one step, built once before the forward."""

    kv_caches: list[torch.Tensor]
    slot_mapping: torch.Tensor  # [T] int64 rows of the flattened [num_blocks * block_size]
    num_tokens: int
    max_context: int
    groups: list[AttentionGroup]  # decode buckets, then the prefill group


def build_metadata(
    starts: np.ndarray,
    num_tokens: np.ndarray,
    slots: np.ndarray,
    positions: np.ndarray,
    block_table: np.ndarray,
    kv_caches: list[torch.Tensor],
    device: torch.device,
) -> AttentionMetadata:
    """Index tensors and masks of a step from the plan's host arrays.

    ``positions`` is ``[T]`` (each token's position); ``block_table`` is the executor's
    ``[num_slots, max_blocks_per_seq]`` table with this step's changes applied.
    """
    block_size = kv_caches[0].shape[3]
    token_slots = np.repeat(slots, num_tokens)
    blocks = block_table[token_slots, positions // block_size].astype(np.int64)
    if (blocks < 0).any():
        raise ValueError("a scheduled position has no block in its slot's block table")
    slot_mapping = blocks * block_size + positions % block_size
    first_token = np.cumsum(num_tokens) - num_tokens
    contexts = starts + num_tokens
    is_decode = num_tokens == 1
    total = int(num_tokens.sum())

    def group(members: np.ndarray) -> AttentionGroup:
        n = num_tokens[members]
        ctx = contexts[members]
        num_queries = int(n.max())
        num_blocks = -(-int(ctx.max()) // block_size)
        # Entries past a shorter sequence's end may be unset (-1): any block will do there,
        # the mask hides it.
        table = np.maximum(block_table[slots[members], :num_blocks], 0).astype(np.int64)
        keys = np.arange(num_blocks * block_size)
        query = np.arange(num_queries)
        # Query r of a chunk sits at position start + r and sees keys 0 ..= start + r.
        # Padded queries (r >= n) also get a non-empty row, so no softmax sees only -inf.
        query_pos = np.minimum(starts[members, None] + query, ctx[:, None] - 1)
        mask = keys[None, None, :] <= query_pos[:, :, None]
        real = query[None, :] < n[:, None]
        rows = first_token[members, None] + np.minimum(query[None, :], n[:, None] - 1)
        in_order = members.all() and (num_queries == 1 or len(n) == 1)
        return AttentionGroup(
            token_idx=None if in_order else _to(rows.reshape(-1), device),
            blocks=_to(table.reshape(-1), device),
            mask=_to(mask[:, None], device),
            num_seqs=len(n),
            num_queries=num_queries,
            fresh=len(n) == 1 and num_queries > 1 and int(starts[members][0]) == 0,
            out_rows=None if real.all() else _to(np.flatnonzero(real), device),
            out_token_idx=None if in_order else _to(rows[real], device),
        )

    members = []
    if is_decode.any():
        # Bucket k holds decodes of 2^(k-1) < blocks <= 2^k (the first bucket: all shorter).
        num_blocks = np.maximum(-(-contexts // block_size), MIN_BUCKET_BLOCKS)
        bucket = np.where(is_decode, np.ceil(np.log2(num_blocks)), -1)
        members += [bucket == b for b in np.unique(bucket[is_decode])]
    if not is_decode.all():
        members.append(~is_decode)
    return AttentionMetadata(
        kv_caches=kv_caches,
        slot_mapping=_to(slot_mapping, device),
        num_tokens=total,
        max_context=int(contexts.max()),
        groups=[group(m) for m in members],
    )


def _to(array: np.ndarray, device: torch.device) -> torch.Tensor:
    tensor = torch.from_numpy(np.ascontiguousarray(array))
    return tensor.to(device, non_blocking=True) if device.type != "cpu" else tensor


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """The registered attention function: ``query`` is ``[1, heads, T, head_dim]``, ``key``
    and ``value`` ``[1, kv_heads, T, head_dim]``; returns ``[1, T, heads, head_dim]`` like
    transformers' SDPA function. See the module docstring for the algorithm."""
    meta = kwargs.get(METADATA_KWARG)
    if not isinstance(meta, AttentionMetadata):
        raise RuntimeError(f"{ATTENTION_NAME} attention needs the {METADATA_KWARG!r} forward kwarg")
    window = kwargs.get("sliding_window")
    if window is not None and int(window) < meta.max_context:  # type: ignore[call-overload]
        raise NotImplementedError(f"sliding window {window} < context {meta.max_context}")
    if kwargs.get("softcap") is not None:
        raise NotImplementedError("attention logit softcapping is not supported")

    cache = meta.kv_caches[module.layer_idx]
    num_kv_heads, head_dim = cache.shape[1], cache.shape[-1]
    # 1. this step's keys and values -> their cache rows (every head at the same row)
    cache[0].view(num_kv_heads, -1, head_dim).index_copy_(1, meta.slot_mapping, key[0])
    cache[1].view(num_kv_heads, -1, head_dim).index_copy_(1, meta.slot_mapping, value[0])

    # 2. attention per group, over contexts read back from the cache
    queries = query[0].transpose(0, 1)  # [T, heads, head_dim]
    num_heads = queries.shape[1]
    groups = meta.groups
    if len(groups) == 1 and groups[0].out_token_idx is None:
        out = _attend(groups[0], queries, cache, scaling, key, value)
    else:
        out = queries.new_empty(meta.num_tokens, num_heads, value.shape[-1])
        for group in groups:
            out.index_copy_(
                0, group.out_token_idx, _attend(group, queries, cache, scaling, key, value)
            )
    return out.unsqueeze(0), None


def _attend(
    group: AttentionGroup,
    queries: torch.Tensor,
    cache: torch.Tensor,
    scaling: float | None,
    key: torch.Tensor,
    value: torch.Tensor,
) -> torch.Tensor:
    """Attention for one group; returns ``[real queries, heads, head_dim]`` in group order."""
    num_kv_heads, head_dim = cache.shape[1], cache.shape[-1]
    n, q_len = group.num_seqs, group.num_queries
    num_heads = queries.shape[1]
    q = queries if group.token_idx is None else queries.index_select(0, group.token_idx)
    gqa = num_heads != num_kv_heads
    if group.fresh:
        if group.token_idx is not None:
            key = key.index_select(2, group.token_idx)
            value = value.index_select(2, group.token_idx)
        q = q.reshape(1, q_len, num_heads, head_dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(
            q, key, value, is_causal=True, scale=scaling, enable_gqa=gqa
        )
        return out[0].transpose(0, 1)
    # [kv_heads, N * blocks, block_size, head_dim] -> [kv_heads, N, L, head_dim]
    keys = cache[0].index_select(1, group.blocks).view(num_kv_heads, n, -1, head_dim)
    values = cache[1].index_select(1, group.blocks).view(num_kv_heads, n, -1, head_dim)
    if q_len == 1:
        # Decode: batch over (kv head, sequence) and fold the query heads sharing a kv head
        # into the query axis (GQA without repeating keys); the mask broadcasts over both.
        q = q.reshape(n, num_kv_heads, num_heads // num_kv_heads, head_dim).transpose(0, 1)
        mask = group.mask.transpose(0, 1)  # [1, N, 1, L]
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scaling)
        return out.transpose(0, 1).reshape(n, num_heads, -1)
    q = q.reshape(n, q_len, num_heads, head_dim).transpose(1, 2)
    out = F.scaled_dot_product_attention(
        q,
        keys.transpose(0, 1),
        values.transpose(0, 1),
        attn_mask=group.mask,
        scale=scaling,
        enable_gqa=gqa,
    )
    out = out.transpose(1, 2).reshape(n * q_len, num_heads, -1)
    return out if group.out_rows is None else out.index_select(0, group.out_rows)


_registered = False


def register_attention() -> None:
    """Register :func:`paged_attention_forward` under :data:`ATTENTION_NAME` (idempotent)."""
    global _registered
    if not _registered:
        AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)
        _registered = True

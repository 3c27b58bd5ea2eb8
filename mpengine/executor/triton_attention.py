"""Paged attention in Triton: one launch per layer for a step's prefill chunks and decodes.

The kernels read and write the KV cache in place, through the step's block table, with an
explicit stride for every dimension of our ``[2, kv_heads, blocks, block_size, head_dim]``
layout, so neither the cache nor the queries need to be contiguous in any order.

One program attends ``BLOCK_Q`` query tokens of one sequence for one KV head and every
query head sharing it (GQA: ``BLOCK_M = BLOCK_Q * group`` rows, keys never repeated). The
grid is ``(num_tokens // BLOCK_Q + num_seqs, kv_heads)``, an upper bound on the query
blocks that depends only on the step's shapes: each program finds its sequence with a
binary search over ``cu_seqlens_q`` and exits if it has no rows. Nothing is read back to
the host and no shape depends on the data, so a step can be captured in a CUDA graph.

Query ``r`` (0-based) of a sequence with ``seq_len`` tokens after this step and ``q_len``
new ones sits at position ``seq_len - q_len + r`` and sees keys ``0 ..= that`` (causal
within the new tokens, everything before them). Softmax is computed online over tiles of
``TILE`` keys (flash attention), accumulating in float32.

Under ``TRITON_INTERPRET=1`` (set before this module is imported) the same kernels run on
the CPU with numpy, which is how the tests compare them with the torch backend.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Keys per inner-loop tile; any block size works (the block of each key is looked up).
TILE = 32


# Triton compiles a variant per integer argument that is 1 or a multiple of 16: counts
# that change every step are not specialised on (each variant was a compile mid-serving).
@triton.jit(do_not_specialize=["num_tokens"])
def _store_kv_kernel(
    key_ptr,  # [kv_heads, T, head_dim] (strided)
    value_ptr,
    cache_ptr,  # [2, kv_heads, blocks, block_size, head_dim] (strided)
    slot_mapping_ptr,  # [T] int64, -1 = do not store (padding)
    num_tokens,
    stride_key_h,
    stride_key_t,
    stride_key_d,
    stride_value_h,
    stride_value_t,
    stride_value_d,
    stride_c_kv: tl.int64,
    stride_c_h: tl.int64,
    stride_c_b: tl.int64,
    stride_c_s: tl.int64,
    stride_c_d: tl.int64,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    KV_HEADS_P2: tl.constexpr,
    HEAD_DIM_P2: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TOKENS: tl.constexpr,  # tokens per program
):
    # Rows: TOKENS tokens; columns: every (kv head, dim) pair of a token.
    tokens = tl.program_id(0) * TOKENS + tl.arange(0, TOKENS)
    slots = tl.load(slot_mapping_ptr + tokens, mask=tokens < num_tokens, other=-1)
    columns = tl.arange(0, KV_HEADS_P2 * HEAD_DIM_P2)
    heads = columns // HEAD_DIM_P2
    dims = columns % HEAD_DIM_P2
    mask = (slots[:, None] >= 0) & (heads[None, :] < NUM_KV_HEADS) & (dims[None, :] < HEAD_DIM)
    block = tl.where(slots >= 0, slots, 0) // BLOCK_SIZE
    offset = tl.where(slots >= 0, slots, 0) % BLOCK_SIZE
    rows = cache_ptr + block[:, None] * stride_c_b + offset[:, None] * stride_c_s
    rows += heads[None, :] * stride_c_h + dims[None, :] * stride_c_d
    key = tl.load(
        key_ptr
        + tokens[:, None] * stride_key_t
        + heads[None, :] * stride_key_h
        + dims[None, :] * stride_key_d,
        mask=mask,
    )
    value = tl.load(
        value_ptr
        + tokens[:, None] * stride_value_t
        + heads[None, :] * stride_value_h
        + dims[None, :] * stride_value_d,
        mask=mask,
    )
    tl.store(rows, key, mask=mask)
    tl.store(rows + stride_c_kv, value, mask=mask)


@triton.jit(do_not_specialize=["num_seqs"])
def _paged_attention_kernel(
    out_ptr,  # [T, heads, head_dim]
    query_ptr,  # [T, heads, head_dim] (strided)
    cache_ptr,  # [2, kv_heads, blocks, block_size, head_dim] (strided)
    block_table_ptr,  # [num_seqs, max_blocks] int32
    seq_lens_ptr,  # [num_seqs] context length after this step
    cu_seqlens_q_ptr,  # [num_seqs + 1] query start offsets
    num_seqs,
    scale,
    stride_out_t,
    stride_out_h,
    stride_q_t,
    stride_q_h,
    stride_q_d,
    stride_c_kv: tl.int64,
    stride_c_h: tl.int64,
    stride_c_b: tl.int64,
    stride_c_s: tl.int64,
    stride_c_d: tl.int64,
    stride_table: tl.int64,
    NUM_HEADS: tl.constexpr,
    GROUP: tl.constexpr,  # query heads per KV head
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P2: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,  # >= BLOCK_Q * GROUP, a power of two
    TILE_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    query_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    # This block's sequence: the last one whose first query block, cu_seqlens_q[i] //
    # BLOCK_Q + i (an upper bound of the blocks before it, so never shared), is <= ours.
    # (Inline rather than a helper: the interpreter pays for every nested jit call.)
    low: tl.int32 = 0
    high = num_seqs
    while low < high:
        mid = (low + high) // 2
        if tl.load(cu_seqlens_q_ptr + mid) // BLOCK_Q + mid <= query_block:
            low = mid + 1
        else:
            high = mid
    seq = low - 1
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    local_block = query_block - (q_start // BLOCK_Q + seq)
    if local_block * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_before = seq_len - q_len

    # Row m: query token local_block * BLOCK_Q + m // GROUP, head kv_head * GROUP + m % GROUP.
    rows = tl.arange(0, BLOCK_M)
    q_index = local_block * BLOCK_Q + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_ok = (q_index < q_len) & (rows < BLOCK_Q * GROUP)
    dims = tl.arange(0, HEAD_DIM_P2)
    dim_ok = dims < HEAD_DIM
    token = q_start + q_index
    q = tl.load(
        query_ptr
        + token[:, None] * stride_q_t
        + head[:, None] * stride_q_h
        + dims[None, :] * stride_q_d,
        mask=row_ok[:, None] & dim_ok[None, :],
        other=0.0,
    )
    q_pos = context_before + q_index

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, dtype=tl.float32)
    acc = tl.full([BLOCK_M, HEAD_DIM_P2], 0.0, dtype=tl.float32)
    # The last key any row of this block sees; tiles past it are skipped.
    last_q = tl.minimum(local_block * BLOCK_Q + BLOCK_Q, q_len) - 1
    num_keys = context_before + last_q + 1
    cols = tl.arange(0, TILE_N)
    keys_base = cache_ptr + kv_head * stride_c_h
    num_tiles = ((num_keys + TILE_N - 1) // TILE_N).to(tl.int32)
    for tile in range(0, num_tiles):
        key_pos = tile * TILE_N + cols
        key_ok = key_pos < num_keys
        block = tl.load(
            block_table_ptr + seq * stride_table + key_pos // BLOCK_SIZE, mask=key_ok, other=0
        ).to(tl.int64)
        key_rows = keys_base + block * stride_c_b + (key_pos % BLOCK_SIZE) * stride_c_s
        k = tl.load(
            key_rows[None, :] + dims[:, None] * stride_c_d,
            mask=dim_ok[:, None] & key_ok[None, :],
            other=0.0,
        )  # [HEAD_DIM_P2, TILE_N]
        v = tl.load(
            key_rows[:, None] + stride_c_kv + dims[None, :] * stride_c_d,
            mask=key_ok[:, None] & dim_ok[None, :],
            other=0.0,
        )  # [TILE_N, HEAD_DIM_P2]
        s = tl.dot(q, k, input_precision=DOT_PRECISION) * scale
        visible = (key_pos[None, :] <= q_pos[:, None]) & key_ok[None, :] & row_ok[:, None]
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # A row that has seen no key yet (or a padding row) keeps a finite reference.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    acc = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(
        out_ptr + token[:, None] * stride_out_t + head[:, None] * stride_out_h + dims[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & dim_ok[None, :],
    )


def store_kv(
    key: torch.Tensor, value: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write ``key``/``value`` (``[kv_heads, T, head_dim]``, any strides) into ``cache`` rows
    ``slot_mapping`` (``[T]``; negative entries are skipped: padding of a captured batch)."""
    num_kv_heads, num_tokens, head_dim = key.shape
    if num_tokens == 0:
        return
    kv_heads_p2 = triton.next_power_of_2(num_kv_heads)
    head_dim_p2 = triton.next_power_of_2(head_dim)
    # A few thousand elements per program: one token of a large model, 16 of a small one.
    tokens = max(1, min(16, 4096 // (kv_heads_p2 * head_dim_p2)))
    _store_kv_kernel[(triton.cdiv(num_tokens, tokens),)](
        key,
        value,
        cache,
        slot_mapping,
        num_tokens,
        *key.stride(),
        *value.stride(),
        *cache.stride(),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        KV_HEADS_P2=kv_heads_p2,
        HEAD_DIM_P2=head_dim_p2,
        BLOCK_SIZE=cache.shape[3],
        TOKENS=tokens,
    )


def paged_attention(
    query: torch.Tensor,
    cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    decode_only: bool = False,
) -> torch.Tensor:
    """Attention of ``query`` (``[T, heads, head_dim]``, any strides) over the paged cache
    (the step's keys must be stored already); returns ``[T, heads, head_dim]``.

    ``decode_only`` (one query per sequence) picks a smaller query block; it must be known
    from the step's shape, never from the data, for a captured graph to stay valid.
    """
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = cache.shape[1]
    group = num_heads // num_kv_heads
    num_seqs = seq_lens.shape[0]
    if out is None:
        out = query.new_empty(num_tokens, num_heads, head_dim)
    if num_tokens == 0:
        return out
    # tl.dot needs >= 16 rows; a long prefill amortises its key loads over more rows.
    block_m = max(16 if decode_only else 64, triton.next_power_of_2(group))
    block_q = block_m // group
    grid = (num_tokens // block_q + num_seqs, num_kv_heads)
    _paged_attention_kernel[grid](
        out,
        query,
        cache,
        block_table,
        seq_lens,
        cu_seqlens_q,
        num_seqs,
        scale,
        out.stride(0),
        out.stride(1),
        *query.stride(),
        *cache.stride(),
        block_table.stride(0),
        NUM_HEADS=num_heads,
        GROUP=group,
        HEAD_DIM=head_dim,
        HEAD_DIM_P2=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_SIZE=cache.shape[3],
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        TILE_N=TILE,
        # float32 stays float32 (no TF32): the engine's float32 mode is its exact mode.
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
    )
    return out

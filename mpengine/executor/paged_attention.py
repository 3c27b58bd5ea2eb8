"""Paged attention as a transformers attention function, over every backend.

The model runs one flattened batch: ``input_ids`` is ``[1, T]`` with every scheduled token
of every sequence, positions restarting per sequence. transformers hands the registered
function ``attention_mask=None`` for a custom implementation, so causality and sequence
boundaries are enforced here, from an :class:`AttentionMetadata` built once per step
(outside the layers) and passed through the model's forward kwargs:

* ``cu_seqlens_q`` ``[N+1]``: where each sequence's new tokens start in the batch;
* ``seq_lens`` ``[N]``: each sequence's context length once this step's tokens are in;
* ``block_table`` ``[N, W]``: the sequences' block table rows, on the device;
* ``slot_mapping`` ``[T]``: the cache row (``block * block_size + offset``) of every new
  token, where its key and value are written.

Each layer makes one attention call that reads and writes the cache (no loop over
sequences or lengths), through the step's backend (see ``attention``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import AttentionInterface

import mpengine.executor.native_attention as native_attention
import mpengine.executor.torch_attention as torch_attention
from mpengine.executor.attention import ATTENTION_NAME, METADATA_KWARG, Backend, StepLayout
from mpengine.executor.torch_attention import TorchPlan, Workspace


@dataclass(slots=True)
class AttentionMetadata:
    """Everything the attention layers need for one step, built once before the forward.

    Its tensors may be the static buffers of a captured CUDA graph: the layers only read
    them, and every shape is fixed by the step's token and sequence counts.
    """

    backend: Backend
    kv_caches: list[torch.Tensor]
    slot_mapping: torch.Tensor  # [T] int64 rows of the flattened [blocks * block_size]
    cu_seqlens_q: torch.Tensor  # [N+1] int64
    seq_lens: torch.Tensor  # [N] int64
    block_table: torch.Tensor  # [N, W] int32
    num_tokens: int
    max_context: int  # on the host: the longest seq_lens (sliding-window check)
    decode_only: bool  # every sequence has one new token (known from the shapes, T == N)
    torch_plan: TorchPlan | None = None  # the torch backend's gather indices and masks


def build_metadata(
    backend: Backend,
    layout: StepLayout,
    kv_caches: list[torch.Tensor],
    slot_mapping: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    workspace: Workspace | None = None,
) -> AttentionMetadata:
    """The metadata of a step whose index tensors are on the device already; ``layout``
    is the same step on the host (what the torch backend plans its gathers from, into
    ``workspace``)."""
    num_tokens = int(layout.num_tokens.sum())
    contexts = layout.starts + layout.num_tokens
    return AttentionMetadata(
        backend=backend,
        kv_caches=kv_caches,
        slot_mapping=slot_mapping,
        cu_seqlens_q=cu_seqlens_q,
        seq_lens=seq_lens,
        block_table=block_table,
        num_tokens=num_tokens,
        max_context=int(contexts.max()) if len(contexts) else 0,
        decode_only=num_tokens == len(contexts),
        torch_plan=torch_attention.plan_step(
            layout,
            kv_caches[0],
            workspace,
            native_attention.kernels() if backend == "native" else None,
        )
        if backend != "triton" and num_tokens
        else None,
    )


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
    transformers' SDPA function."""
    meta = kwargs.get(METADATA_KWARG)
    if not isinstance(meta, AttentionMetadata):
        raise RuntimeError(f"{ATTENTION_NAME} attention needs the {METADATA_KWARG!r} forward kwarg")
    window = kwargs.get("sliding_window")
    if window is not None and int(window) < meta.max_context:  # type: ignore[call-overload]
        raise NotImplementedError(f"sliding window {window} < context {meta.max_context}")
    if kwargs.get("softcap") is not None:
        raise NotImplementedError("attention logit softcapping is not supported")

    cache = meta.kv_caches[module.layer_idx]
    if meta.backend == "triton":
        # Imported on first use: only a CUDA step needs Triton, which a CPU install may lack.
        import mpengine.executor.triton_attention as triton_attention

        triton_attention.store_kv(key[0], value[0], cache, meta.slot_mapping)
        scale = query.shape[-1] ** -0.5 if scaling is None else scaling
        out = triton_attention.paged_attention(
            query[0].transpose(0, 1),
            cache,
            meta.block_table,
            meta.seq_lens,
            meta.cu_seqlens_q,
            scale,
            decode_only=meta.decode_only,
        )
    else:
        assert meta.torch_plan is not None
        out = torch_attention.attend(
            meta.torch_plan, cache, meta.slot_mapping, query, key, value, scaling
        )
    return out.unsqueeze(0), None


_registered = False


def register_attention() -> None:
    """Register :func:`paged_attention_forward` under :data:`ATTENTION_NAME` (idempotent)."""
    global _registered
    if not _registered:
        AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)
        _registered = True

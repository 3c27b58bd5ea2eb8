"""What every paged attention backend shares: the names a model's forward uses, the
backends and the choice between them, and a step's layout on the host.

The model runs one flattened batch of every scheduled token (see ``paged_attention``, the
attention function transformers calls, which hands each layer to its backend). Backends,
chosen by device type (:func:`choose_backend`):

* ``torch`` (the reference; the CPU's fallback): ``index_copy_`` + attention over gathered
  blocks, decodes and prefill chunks in one call each (see ``torch_attention``);
* ``native`` (the CPU's default where a C compiler is found): the torch backend with its
  cache writes and decodes in C, reading the blocks in place (see ``native_attention``);
* ``triton`` (CUDA): one kernel launch per layer that reads the cache in place through the
  block table, safe to capture in a CUDA graph (see ``triton_attention``).

This module imports no backend that plans from a :class:`StepLayout`, so each of them can
import it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

import mpengine.executor.native_attention as native_attention

ATTENTION_NAME = "mpengine_paged"
METADATA_KWARG = "mpengine_attention"

Backend = Literal["torch", "native", "triton"]
BACKENDS: tuple[Backend, ...] = ("torch", "native", "triton")


@dataclass(slots=True)
class StepLayout:
    """A step's sequences on the host: what every backend plans from."""

    starts: np.ndarray  # [N] int64, position of each sequence's first new token
    num_tokens: np.ndarray  # [N] int64, new tokens per sequence
    block_table: np.ndarray  # [N, W] int32, the sequences' block table rows (-1: none)
    block_size: int


def choose_backend(
    requested: Backend | None, device: torch.device, cache: torch.Tensor, num_heads: int
) -> Backend:
    """``requested``, checked, or the device's default: triton on a GPU; on the CPU native
    where its kernels build and take the model's ``cache`` (a layer's, or one of its shape
    and dtype) and query heads, else torch. The Triton kernels only run on a CPU under
    their interpreter (``TRITON_INTERPRET=1``, for tests)."""
    if requested is not None and requested not in BACKENDS:
        raise ValueError(f"attention backend {requested!r} is not one of {BACKENDS}")
    if requested is None and device.type == "cuda":
        return "triton"
    lib = native_attention.kernels() if device.type == "cpu" else None
    if requested is None:
        return "native" if lib is not None and lib.supports(cache, num_heads) else "torch"
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    if requested == "triton" and device.type != "cuda" and not interpreted:
        raise ValueError(
            "triton attention needs a CUDA device (on the CPU its kernels only run under the "
            "interpreter, TRITON_INTERPRET=1, for tests)"
        )
    if requested == "triton" and device.type != "cuda" and cache.dtype == torch.bfloat16:
        # Its tl.dot multiplies bfloat16 inputs' bit patterns as integers (a 16 x 16 dot
        # off by 1e10; triton-lang/triton#11584): the engine served nonsense, no error.
        raise ValueError(
            "triton attention under the interpreter cannot compute in bfloat16 (its tl.dot "
            "is wrong there): use float32 or float16, or the torch backend, on the CPU"
        )
    if requested == "native":
        if lib is None:
            raise ValueError("native attention needs its kernels, built with a C compiler")
        if not lib.supports(cache, num_heads):
            _, kv_heads, _, block_size, head_dim = cache.shape
            raise ValueError(
                f"native attention takes float32 or bfloat16 CPU caches, head_dim <= "
                f"{lib.max_head_dim}, block_size <= {lib.max_block_size} and at most "
                f"{lib.max_group} query heads per KV head, not {device} {cache.dtype}, head_dim "
                f"{head_dim}, block_size {block_size}, {num_heads} heads over {kv_heads}"
            )
    return requested

"""Slicing and joining ``Logprobs`` without leaving their raw bytes.

A step's ``Logprobs`` hold rows for many sequences, with as many top-N columns as the
largest request of the step asked for. A sequence gets its own row, cut to its own N: the
first N entries of a row-major row are contiguous, so this is one byte slice per field
and no numpy on the per-token path.
"""

from __future__ import annotations

import numpy as np

from mpengine.protocol import EMPTY_IDS, Array, Logprobs, PromptLogprobs

_ITEMSIZE = {"int32": 4, "int64": 8, "float16": 2, "float32": 4, "bool": 1}


def _row(arr: Array, row: int, width: int, num: int) -> Array:
    """The first ``num`` entries of row ``row`` of a ``[rows, width]`` (or ``[rows]``) array:
    contiguous bytes, so one slice."""
    size = _ITEMSIZE[arr.dtype]
    start = row * width * size
    shape = (1,) if len(arr.shape) == 1 else (1, num)
    return Array(arr.dtype, shape, arr.data[start : start + num * size])


def logprob_row(logprobs: Logprobs, row: int, num_top: int) -> Logprobs:
    """Row ``row`` of a step's logprobs, with at most ``num_top`` alternatives."""
    top_shape = logprobs.top_ids.shape
    width = top_shape[1] if len(top_shape) == 2 else 0
    num = min(num_top, width)
    return Logprobs(
        _row(logprobs.token_ids, row, 1, 1),
        _row(logprobs.logprobs, row, 1, 1),
        _row(logprobs.top_ids, row, width, num),
        _row(logprobs.top_logprobs, row, width, num),
    )


def concat_logprobs(chunks: list[PromptLogprobs], num_top: int) -> Logprobs:
    """Join a sequence's prompt logprob chunks in position order.

    A position can arrive twice (a sequence preempted before its first output recomputes
    its prompt): the first value is kept, so the result does not depend on preemption.
    """
    if not chunks:  # a one-token prompt: no position is scored (its first has no logprob)
        return Logprobs(
            Array.of(np.zeros(0, np.int32), "int32"),
            Array.of(np.zeros(0, np.float32), "float32"),
            Array.of(np.zeros((0, num_top), np.int32), "int32"),
            Array.of(np.zeros((0, num_top), np.float32), "float32"),
            Array.of(np.zeros(0, np.int32), "int32"),
        )
    first: dict[int, int] = {}  # position -> row in the stacked chunks
    offset = 0
    for chunk in chunks:
        num_rows = len(chunk.logprobs.token_ids)
        for row in range(num_rows):
            first.setdefault(chunk.start + row, offset + row)
        offset += num_rows
    rows = np.fromiter((first[p] for p in sorted(first)), np.int64, len(first))

    def gather(name: str) -> Array:
        parts = [getattr(c.logprobs, name).numpy() for c in chunks]
        stacked = np.concatenate(parts)[rows]
        return Array.of(stacked if stacked.ndim == 1 else stacked[:, :num_top], parts[0].dtype.name)

    with_ranks = all(c.logprobs.ranks.shape[0] for c in chunks)
    return Logprobs(
        gather("token_ids"),
        gather("logprobs"),
        gather("top_ids"),
        gather("top_logprobs"),
        gather("ranks") if with_ranks else EMPTY_IDS,
    )


def join_logprobs(rows: list[Logprobs]) -> Logprobs:
    """Consecutive per-token rows of one sequence as one ``Logprobs`` (all of one width)."""

    def join(name: str) -> Array:
        parts = [getattr(row, name) for row in rows]
        shape = (sum(p.shape[0] for p in parts), *parts[0].shape[1:])
        return Array(parts[0].dtype, shape, b"".join(p.data for p in parts))

    return Logprobs(join("token_ids"), join("logprobs"), join("top_ids"), join("top_logprobs"))

"""The executor's checks of the scheduler's plans: what it refuses to run, and why.

The scheduler plans within the executor's limits, but a plan that breaks them must cost
no more than the sequences it names. An index the plan carries reaches the device as a
read or write out of range, which on a GPU is a device-side assert that ends the process
(and every request with it); a sequence run without its state serves wrong tokens. So
every index is checked on the host first, in two kinds:

* the plan's shape (arrays that disagree in length, a slot out of range, a block-table
  entry outside the table or the cache) makes the plan wrong as a whole: ``ValueError``,
  and every sequence of the step fails;
* a sequence that cannot run (a token id outside the vocabulary, positions past
  ``max_model_len``, a ``-1`` token its slot has nothing for, a slot it no longer holds,
  prefix blocks that a failed sequence of the same step was to compute) fails alone, with
  its reason; the rest of the step runs.

Pure functions over host arrays: no torch, no executor state.
"""

from __future__ import annotations

import numpy as np

from mpengine.executor.step_rows import StepRows

READS_UNWRITTEN = "its prompt's prefix blocks were computed by a sequence that failed"
NOT_WHOLE = "an encoder model computes whole prompts, in one step"


def check_rows(rows: StepRows, num_slots: int) -> None:
    """The plan's shape; a plan that fails these is wrong as a whole."""
    n = len(rows.slots)
    if not len(rows.starts) == len(rows.num_tokens) == len(rows.sample) == len(rows.seq_ids) == n:
        raise ValueError("plan arrays differ in length")
    if n and rows.num_tokens.min() < 1:
        raise ValueError("every scheduled sequence needs >= 1 token")
    if len(rows.token_ids) != int(rows.num_tokens.sum()):
        raise ValueError(
            f"plan has {len(rows.token_ids)} token ids for {rows.num_tokens.sum()} tokens"
        )
    if n and (rows.slots.min() < 0 or rows.slots.max() >= num_slots):
        raise ValueError(f"slot out of range [0, {num_slots})")


def check_block_updates(
    slots: np.ndarray,
    indices: np.ndarray,
    block_ids: np.ndarray,
    table_shape: tuple[int, ...],
    num_blocks: int,
) -> None:
    """Block-table deltas ``table[slots, indices] = block_ids`` (non-empty) that stay inside
    the table (``table_shape``: slots x blocks per sequence) and the cache's blocks."""
    if not len(slots) == len(indices) == len(block_ids):
        raise ValueError("block_slots, block_indices and block_ids differ in length")
    if slots.min() < 0 or slots.max() >= table_shape[0]:
        raise ValueError("block table update names a slot out of range")
    if indices.min() < 0 or indices.max() >= table_shape[1]:
        raise ValueError(f"block index out of range [0, {table_shape[1]})")
    if block_ids.min() < 0 or block_ids.max() >= num_blocks:
        raise ValueError(f"block id out of range [0, {num_blocks})")


def slots_in_range(slots: np.ndarray, num_slots: int) -> np.ndarray:
    """``slots`` without those out of ``[0, num_slots)`` (whose starts failed already)."""
    return slots[(slots >= 0) & (slots < num_slots)]


def why_unrunnable(
    rows: StepRows,
    last_token: np.ndarray,
    slot_seq_ids: np.ndarray,
    vocab_size: int,
    max_model_len: int,
) -> np.ndarray:
    """Per row (of a plan that passed :func:`check_rows`), why it cannot run: an object
    array of reasons, ``""`` for a row that can. ``last_token`` and ``slot_seq_ids`` are
    per slot: its last sampled token (-1: none yet) and the sequence that holds it."""
    reasons = np.full(len(rows), "", dtype=object)
    token_row = np.repeat(np.arange(len(rows)), rows.num_tokens)
    pending = rows.token_ids < 0
    no_token = np.zeros(len(rows), bool)
    no_token[token_row[pending & (last_token[rows.slots[token_row]] < 0)]] = True
    bad_id = np.zeros(len(rows), bool)
    bad_id[token_row[rows.token_ids >= vocab_size]] = True
    # Later reasons take precedence over earlier ones.
    reasons[bad_id] = f"a token id is out of range [0, {vocab_size})"
    reasons[no_token] = "a -1 token refers to a slot that has sampled nothing yet"
    reasons[(rows.starts < 0) | (rows.starts + rows.num_tokens > max_model_len)] = (
        f"positions outside [0, max_model_len={max_model_len})"
    )
    reasons[slot_seq_ids[rows.slots] != rows.seq_ids] = (
        "the sequence does not hold its slot (an earlier step of it failed)"
    )
    return reasons


def readers_of_unwritten(
    rows: StepRows, keep: np.ndarray, block_table: np.ndarray, block_size: int
) -> list[int]:
    """The rows in ``keep`` that read prefix blocks the rows not kept were to write, in the
    order found.

    A sequence may start from prefix blocks another sequence of the same step computes
    (the scheduler shares them at once, as vLLM does): when that one cannot run, its
    blocks stay unwritten, and the sequences reading them must fail too, rather than attend
    to whatever the blocks held. A reader dropped leaves its own blocks unwritten in turn,
    so this repeats until no more rows drop.
    """
    keep = keep.copy()
    readers: list[int] = []
    while True:
        unwritten: set[int] = set()
        for i in np.flatnonzero(~keep):
            slot, start = rows.slots[i], rows.starts[i]
            if 0 <= slot < len(block_table):
                first, last = start // block_size, (start + rows.num_tokens[i] - 1) // block_size
                unwritten.update(block_table[slot, first : last + 1].tolist())
        unwritten.discard(-1)
        num_readers = len(readers)
        for j in np.flatnonzero(keep):
            read = block_table[rows.slots[j], : -(-int(rows.starts[j]) // block_size)].tolist()
            if not unwritten.isdisjoint(read):
                keep[j] = False
                readers.append(int(j))
        if len(readers) == num_readers:
            return readers


def whole_prompts(rows: StepRows, num_prompt: np.ndarray, pool_kind: np.ndarray) -> np.ndarray:
    """Which rows are a pooling sequence's whole prompt, computed and pooled in one step
    (all an encoder can run: it keeps no KV cache between steps); ``num_prompt`` and
    ``pool_kind`` are per slot."""
    whole = (rows.starts == 0) & (rows.num_tokens == num_prompt[rows.slots]) & rows.sample
    return whole & (pool_kind[rows.slots] >= 0)

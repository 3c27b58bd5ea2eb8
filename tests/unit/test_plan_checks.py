"""The executor's checks of a plan, on host arrays alone (no model): what fails the whole
step, what fails one sequence, and why."""

from __future__ import annotations

import numpy as np
import pytest

import mpengine.executor.plan_checks as plan_checks
from mpengine.executor.step_rows import StepRows


def rows(
    slots: list[int],
    starts: list[int],
    num_tokens: list[int],
    token_ids: list[int] | None = None,
    sample: list[bool] | None = None,
) -> StepRows:
    n = len(slots)
    tokens = token_ids if token_ids is not None else [5] * sum(num_tokens)
    return StepRows(
        slots=np.asarray(slots, np.int64),
        starts=np.asarray(starts, np.int64),
        num_tokens=np.asarray(num_tokens, np.int64),
        sample=np.asarray(sample if sample is not None else [True] * n, bool),
        seq_ids=np.arange(10, 10 + n, dtype=np.int64),
        token_ids=np.asarray(tokens, np.int64),
    )


def test_a_plan_of_the_wrong_shape_fails_as_a_whole() -> None:
    plan_checks.check_rows(rows([0, 1], [0, 4], [3, 1]), num_slots=2)
    with pytest.raises(ValueError, match="needs >= 1 token"):
        plan_checks.check_rows(rows([0, 1], [0, 4], [3, 0]), num_slots=2)
    with pytest.raises(ValueError, match="3 token ids for 4 tokens"):
        plan_checks.check_rows(rows([0, 1], [0, 4], [3, 1], token_ids=[5, 5, 5]), num_slots=2)
    with pytest.raises(ValueError, match=r"slot out of range \[0, 2\)"):
        plan_checks.check_rows(rows([0, 2], [0, 4], [3, 1]), num_slots=2)
    short = rows([0, 1], [0, 4], [3, 1])
    short.seq_ids = short.seq_ids[:1]
    with pytest.raises(ValueError, match="differ in length"):
        plan_checks.check_rows(short, num_slots=2)


def test_block_table_updates_stay_in_the_table_and_the_cache() -> None:
    ids = np.array([0, 1])
    plan_checks.check_block_updates(ids, ids, np.array([3, 7]), (2, 4), num_blocks=8)
    with pytest.raises(ValueError, match="differ in length"):
        plan_checks.check_block_updates(ids, ids, np.array([3]), (2, 4), num_blocks=8)
    with pytest.raises(ValueError, match="slot out of range"):
        plan_checks.check_block_updates(np.array([0, 2]), ids, ids, (2, 4), num_blocks=8)
    with pytest.raises(ValueError, match=r"block index out of range \[0, 4\)"):
        plan_checks.check_block_updates(ids, np.array([-1, 0]), ids, (2, 4), num_blocks=8)
    with pytest.raises(ValueError, match=r"block id out of range \[0, 8\)"):
        plan_checks.check_block_updates(ids, ids, np.array([3, 8]), (2, 4), num_blocks=8)


def test_each_sequence_that_cannot_run_gets_its_reason() -> None:
    step = rows(
        [0, 1, 2, 3, 4],
        [0, 0, 14, 0, 0],
        [2, 1, 3, 1, 1],
        token_ids=[5, 99, -1, 5, 6, 7, -1, 5],
    )
    last_token = np.array([-1, -1, 4, 4, 4])
    holders = np.array([10, 11, 12, 13, 99])  # slot 4 went to another sequence
    reasons = plan_checks.why_unrunnable(step, last_token, holders, 50, max_model_len=16)
    assert reasons[0] == "a token id is out of range [0, 50)"
    assert reasons[1] == "a -1 token refers to a slot that has sampled nothing yet"
    assert reasons[2] == "positions outside [0, max_model_len=16)"
    assert reasons[3] == ""  # a -1 token its slot has
    assert "does not hold its slot" in reasons[4]


def test_readers_of_blocks_a_failed_writer_left_unwritten_fail_in_turn() -> None:
    """Row 0 cannot run: its block 10 stays unwritten. Row 2 starts after it, so fails too,
    which leaves its block 11 unwritten for row 1, found in the next round; row 3 reads
    no block."""
    table = np.array([[10, -1], [11, 15], [10, 11], [13, -1]], np.int32)
    step = rows([0, 1, 2, 3], [0, 4, 4, 0], [4, 1, 4, 1])
    keep = np.array([False, True, True, True])
    assert plan_checks.readers_of_unwritten(step, keep, table, block_size=4) == [2, 1]
    assert keep.tolist() == [False, True, True, True]  # the caller's mask is left alone
    keep[0] = True
    assert plan_checks.readers_of_unwritten(step, keep, table, block_size=4) == []


def test_an_encoder_runs_only_whole_prompts_that_pool() -> None:
    step = rows([0, 1, 2, 3], [0, 0, 2, 0], [4, 3, 2, 4], sample=[True, True, True, False])
    num_prompt = np.array([4, 4, 4, 4])
    pool_kind = np.array([0, 0, 0, 0], np.int8)
    whole = plan_checks.whole_prompts(step, num_prompt, pool_kind)
    assert whole.tolist() == [True, False, False, False]
    pool_kind[0] = -1  # a sequence that samples
    assert not plan_checks.whole_prompts(step, num_prompt, pool_kind).any()

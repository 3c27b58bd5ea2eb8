"""Swap preemption (``preemption_mode="swap"``): host blocks that hold preempted sequences'
KV, and the copies the next plan lists (the executor does every swap-out, then every
swap-in, before the step's forward)."""

from __future__ import annotations

from collections import deque

import numpy as np

from mpengine.limits import FrameLimits
from mpengine.protocol import EMPTY_IDS, Array
from mpengine.scheduler.block_manager import BlockManager
from mpengine.scheduler.request import Sequence
from mpengine.scheduler.step import StepBudget

COPY_BYTES = 8  # a (from, to) pair of block ids in the plan


class HostSwap:
    """Free host blocks (none: preemption recomputes), and this plan's copies."""

    def __init__(self, num_host_blocks: int) -> None:
        self.free_host_blocks: deque[int] = deque(range(num_host_blocks))
        self.swap_outs: list[tuple[int, int]] = []  # (device block, host block)
        self.swap_ins: list[tuple[int, int]] = []  # (host block, device block)

    @property
    def num_pending_bytes(self) -> int:
        """What the swap-outs issued for a step that then planned nothing take of the next
        plan (their blocks are free already: its forward must come after the copies)."""
        return COPY_BYTES * len(self.swap_outs)

    def swap_out(self, seq: Sequence, budget: StepBudget) -> bool:
        """Copy ``seq``'s blocks to host memory (listed in the plan, done before its
        forward, so the blocks can serve another sequence in the same step); False when it
        must recompute instead: swap off or full, a pooling sequence (its running sums are
        per slot), penalties (their token history is per slot), or a prompt still being
        scored (its slot scores from the first prefill only)."""
        request = seq.request
        num_blocks = len(seq.block_ids)
        if (
            not num_blocks
            or num_blocks > len(self.free_host_blocks)
            or request.pooling is not None
            or request.beam_search  # another beam may continue it meanwhile
            or (request.sampling is not None and request.sampling.has_penalties)
            or seq.scores_prompt
            or COPY_BYTES * num_blocks > budget.num_frame_bytes
        ):
            return False
        budget.num_frame_bytes -= COPY_BYTES * num_blocks
        host = [self.free_host_blocks.popleft() for _ in range(num_blocks)]
        self.swap_outs += zip(seq.block_ids, host, strict=True)
        seq.host_block_ids = host
        return True

    def swap_in(
        self, seq: Sequence, num_tokens: int, blocks: BlockManager, budget: StepBudget
    ) -> int | None:
        """Make room for a swapped-out sequence to compute ``num_tokens`` more: device
        blocks for its host blocks (copied in before this step's forward), which it holds
        on return. The new blocks its chunk needs beyond them, or None (nothing taken) when
        it does not fit this step."""
        host = seq.host_block_ids
        need = blocks.blocks_for(seq.num_computed + num_tokens) - len(host)
        cost = FrameLimits.shared_table_bytes(len(host)) + COPY_BYTES * len(host)
        if num_tokens == 0 or cost > budget.num_frame_bytes:
            return None
        if not blocks.can_allocate(len(host) + max(need, 0)):
            return None
        budget.num_frame_bytes -= cost
        seq.block_ids = blocks.allocate(len(host))
        self.swap_ins += zip(host, seq.block_ids, strict=True)
        self.free_host_blocks.extend(host)
        seq.host_block_ids = []
        return need

    def drop(self, seq: Sequence) -> None:
        """``seq`` finished while swapped out: its host blocks are free again."""
        self.free_host_blocks.extend(seq.host_block_ids)
        seq.host_block_ids = []

    def take_copies(self) -> tuple[Array, Array]:
        """The swap-outs and swap-ins for the plan being sent, flattened."""
        copies = _flat(self.swap_outs), _flat(self.swap_ins)
        self.swap_outs, self.swap_ins = [], []
        return copies


def _flat(pairs: list[tuple[int, int]]) -> Array:
    return Array.of(np.asarray(pairs, np.int32).reshape(-1)) if pairs else EMPTY_IDS

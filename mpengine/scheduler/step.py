"""The step being built: what it may still spend, and what it has taken so far."""

from __future__ import annotations

from dataclasses import dataclass, field

from mpengine.protocol import RequestParams, SeqStart
from mpengine.scheduler.request import Sequence

BlockDelta = tuple[int, int, int]  # (slot, index in its block table, block id)


@dataclass(slots=True)
class StepBudget:
    """What the step being built may still spend, each bound derived once (``limits.py``):

    - ``num_tokens``: tokens to compute (``max_num_batched_tokens``);
    - ``num_frame_bytes``: the plan frame's variable part (``plan_extra_bytes``): request
      parameters, the block tables a new slot shares, swap copies;
    - ``num_prompt_logprob_tokens``: prompt positions to score
      (``max_prompt_logprob_tokens``), which bounds the result frame.

    Whoever takes a chunk or a frame part spends it here; a victim's chunk given back
    returns its share."""

    num_tokens: int
    num_frame_bytes: int
    num_prompt_logprob_tokens: int

    def __post_init__(self) -> None:
        assert self.num_tokens >= 0 and self.num_frame_bytes >= 0
        assert self.num_prompt_logprob_tokens >= 0

    def take(self, seq: Sequence, num_tokens: int) -> None:
        """Spend a chunk of ``num_tokens`` of ``seq`` (not yet computed)."""
        self.num_tokens -= num_tokens
        if seq.scores_prompt:
            self.num_prompt_logprob_tokens -= num_tokens

    def give_back(self, seq: Sequence, num_tokens: int) -> None:
        """Return the chunk ``take`` spent (``seq`` unchanged since)."""
        self.num_tokens += num_tokens
        if seq.scores_prompt:
            self.num_prompt_logprob_tokens += num_tokens


@dataclass(slots=True)
class StepBatch:
    """What step ``step`` computes, as decided so far: a chunk of tokens per sequence (in
    plan order), the slots it starts, the parameters the executor learns with them, and the
    block-table rows that change."""

    step: int
    chunks: list[tuple[Sequence, int]] = field(default_factory=list)
    starts: list[SeqStart] = field(default_factory=list)
    new_requests: list[RequestParams] = field(default_factory=list)
    block_deltas: list[BlockDelta] = field(default_factory=list)

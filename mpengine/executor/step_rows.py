"""A plan's scheduled sequences on the host: the rows a step is laid out from."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mpengine.protocol import StepPlan


@dataclass(slots=True)
class StepRows:
    """A step's scheduled sequences, one row each in plan order, as writable host arrays.

    Row ``i`` computes ``num_tokens[i]`` tokens of sequence ``seq_ids[i]`` in slot
    ``slots[i]``, at positions ``starts[i] ..``; ``token_ids`` holds every row's tokens,
    concatenated (``-1``: the slot's last sampled token).
    """

    slots: np.ndarray  # [N] int64
    starts: np.ndarray  # [N] int64, position of each row's first new token
    num_tokens: np.ndarray  # [N] int64, new tokens per row
    sample: np.ndarray  # [N] bool, the row samples (or pools) after its tokens
    seq_ids: np.ndarray  # [N] int64
    token_ids: np.ndarray  # [T] int64, T = num_tokens.sum()

    @classmethod
    def of(cls, plan: StepPlan) -> StepRows:
        """Copies of the plan's arrays, unchecked (``plan_checks.check_rows`` checks them)."""
        return cls(
            slots=plan.slots.numpy().astype(np.int64),
            starts=plan.starts.numpy().astype(np.int64),
            num_tokens=plan.num_tokens.numpy().astype(np.int64),
            sample=plan.sample.numpy().astype(bool),
            seq_ids=plan.seq_ids.numpy().astype(np.int64),
            token_ids=plan.token_ids.numpy().astype(np.int64),
        )

    def __len__(self) -> int:
        return len(self.slots)

    @property
    def first_token(self) -> np.ndarray:
        """[N] where each row's tokens start in ``token_ids`` (and in the step's batch)."""
        return np.cumsum(self.num_tokens) - self.num_tokens

    def token_slots(self) -> np.ndarray:
        """[T] the slot of each token of ``token_ids``."""
        return np.repeat(self.slots, self.num_tokens)

    def positions(self) -> np.ndarray:
        """[T] the position of each token of ``token_ids`` in its sequence."""
        offsets = np.repeat(self.starts - self.first_token, self.num_tokens)
        return np.arange(len(self.token_ids)) + offsets

    def select(self, keep: np.ndarray) -> StepRows:
        """The rows where ``keep`` ([N] bool) is set, with their tokens."""
        return StepRows(
            slots=self.slots[keep],
            starts=self.starts[keep],
            num_tokens=self.num_tokens[keep],
            sample=self.sample[keep],
            seq_ids=self.seq_ids[keep],
            token_ids=self.token_ids[np.repeat(keep, self.num_tokens)],
        )

"""Injected failures, for the tests of failure handling: an executor that fails where the
debug switches say (``mpengine.envs``), chosen at stage start only when one is set.

- ``MPENGINE_FAULT_STEPS``: the forward of these steps raises, as a device error would
  (every sequence of the step fails; the engine must keep serving the rest);
- ``MPENGINE_FAULT_SEQS``: the sampling of these sequences raises (only they fail).

The executor that serves is :class:`~mpengine.executor.executor.Executor` itself, with no
fault branch on its hot path; :class:`FaultyExecutor` raises in the overridden steps and
otherwise runs the same code.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch

from mpengine.config import EngineConfig
from mpengine.envs import InjectedFault, fault_seqs, fault_steps
from mpengine.executor.attention import Backend
from mpengine.executor.executor import Executor
from mpengine.executor.input_batch import StepInputs
from mpengine.executor.sampler import PendingSample
from mpengine.executor.step_rows import StepRows
from mpengine.executor.tensor_parallel import RankGroup
from mpengine.protocol import StepPlan, StepResult

logger = logging.getLogger(__name__)


def create_executor(config: EngineConfig, ranks: RankGroup | None = None) -> Executor:
    """The executor a stage runs (a tensor-parallel rank of ``ranks``): a
    :class:`FaultyExecutor` when a fault switch is set in the environment, else the plain
    :class:`Executor`."""
    steps, seqs = fault_steps(), fault_seqs()
    if not steps and not seqs:
        return Executor(config, ranks=ranks)
    logger.warning(
        "fault injection: failing the forward of steps %s, sampling of seqs %s",
        sorted(steps),
        sorted(seqs),
    )
    return FaultyExecutor(config, steps, seqs, ranks=ranks)


class FaultyExecutor(Executor):
    """An :class:`Executor` whose forward fails in ``fault_steps`` and whose sampling fails
    for ``fault_seqs``, with :class:`~mpengine.envs.InjectedFault`."""

    def __init__(
        self,
        config: EngineConfig,
        fault_steps: frozenset[int],
        fault_seqs: frozenset[int],
        attention_backend: Backend | None = None,
        ranks: RankGroup | None = None,
    ) -> None:
        super().__init__(config, attention_backend, ranks)
        self.fault_steps = fault_steps
        self.fault_seqs = fault_seqs
        self._step = -1  # the step being run

    def execute(self, plan: StepPlan) -> StepResult:
        self._step = plan.step
        return super().execute(plan)

    def _forward(
        self, inputs: StepInputs, pools: bool
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        self._fail_step()
        return super()._forward(inputs, pools)

    def _encode(self, rows: StepRows) -> torch.Tensor:
        self._fail_step()
        return super()._encode(rows)

    def _fail_step(self) -> None:
        if self._step in self.fault_steps:
            raise InjectedFault(f"injected failure of step {self._step} (MPENGINE_FAULT_STEPS)")

    def _sample_rows(
        self, logits: torch.Tensor, slots: np.ndarray, *rest: Any, **kwargs: Any
    ) -> PendingSample:
        if not self.fault_seqs.isdisjoint(self.slots.seq_id[slots].tolist()):
            raise InjectedFault("injected sampling failure (MPENGINE_FAULT_SEQS)")
        return super()._sample_rows(logits, slots, *rest, **kwargs)

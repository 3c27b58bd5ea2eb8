"""The executor's tensor-parallel ranks as processes: ``mpengine: executor`` is rank 0,
``mpengine: executor tp1`` ... the others.

Rank 0 is the executor stage of ``processes.py``: it reads the plans from the plan ring,
and before running each it puts the same frame on the ranks' broadcast ring
(``shm.broadcast``, one writer, a reader per other rank), whose readers run it in step
(``rank_loop``). Their steps meet in the model's collectives and in the sampled ids rank 0
sends them (``executor.tensor_parallel``); only rank 0 writes results, so the lockstep
counter and the other stages are as with one executor.

The launcher starts every rank at once (they create the process group together), makes
the broadcast ring and the group's address, and supervises each rank as a stage: a rank
that dies ends the engine (its peers cannot go on without it).
"""

from __future__ import annotations

import logging
import re
from typing import TYPE_CHECKING

from mpengine.config import EngineConfig
from mpengine.protocol import StepPlan, Wiring, plan_decoder
from mpengine.runtime.stage import Control, StopFlag
from shm.broadcast import Broadcast, PeerGone

if TYPE_CHECKING:
    from mpengine.executor import Executor
    from mpengine.executor.tensor_parallel import RankGroup

logger = logging.getLogger(__name__)

POLL_S = 0.05
_RANK_STAGE = re.compile(r"executor tp([1-9][0-9]*)")


def rank_stages(config: EngineConfig) -> tuple[str, ...]:
    """The stage names of the ranks but rank 0 (the executor)."""
    return tuple(f"executor tp{rank}" for rank in range(1, config.tensor_parallel_size))


def rank_of(stage: str) -> int | None:
    """The rank that runs as ``stage`` (``executor tpN``), or None."""
    match = _RANK_STAGE.fullmatch(stage)
    return int(match.group(1)) if match else None


def join_ranks(config: EngineConfig, wiring: Wiring, rank: int) -> RankGroup | None:
    """This process's rank in the executor's process group (None with one rank)."""
    if config.tensor_parallel_size == 1:
        return None
    from mpengine.executor.model_loader import check_tensor_parallel, resolve_device
    from mpengine.executor.tensor_parallel import RankGroup

    check_tensor_parallel(config)  # (every rank refuses alike, before any waits for another)
    device = resolve_device(config.device)
    size = config.tensor_parallel_size
    return RankGroup(rank, size, device, wiring.dist_init, config.startup_timeout)


def run_rank(
    config: EngineConfig, wiring: Wiring, control: Control, stop: StopFlag, rank: int
) -> None:
    """A rank other than 0: joins the group, loads its part of the model, then runs every
    plan rank 0 broadcasts."""
    from mpengine.executor import create_executor

    ranks = join_ranks(config, wiring, rank)
    assert ranks is not None and rank > 0
    executor = create_executor(config, ranks)
    with Broadcast.reader(wiring.rank_ring, rank - 1) as plans:
        control.ready()
        rank_loop(executor, plans, stop, wiring.executor_generation)


def rank_loop(executor: Executor, plans: Broadcast, stop: StopFlag, generation: int) -> None:
    decoder = plan_decoder()
    while not stop:
        try:
            frame = plans.get(POLL_S)
        except TimeoutError:
            continue
        except PeerGone:
            if stop:  # (rank 0 stopped first)
                return
            raise
        plan: StepPlan = decoder.decode(frame)
        if plan.generation == generation:
            executor.execute(plan)

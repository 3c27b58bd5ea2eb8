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

Across hosts (``nnodes``): node 0 runs the engine with its share of the ranks, every other
node ``mpengine serve --headless`` (``headless.py``) with its own; the process group meets
at ``master_addr:master_port``, and the other nodes' ranks take the plans from rank 0 over
ZMQ (``remote_plans.py``) instead of the ring.
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import msgspec

from mpengine.addresses import free_port
from mpengine.config import EngineConfig
from mpengine.protocol import StageTimes, StepPlan, Wiring, encoder, plan_decoder
from mpengine.runtime.remote_plans import PlanPublisher, PlanSubscriber, plan_address
from mpengine.runtime.stage import Control, StopFlag
from mpengine.runtime.timing import Clock
from shm.broadcast import Broadcast, Frame, PeerGone

if TYPE_CHECKING:
    from mpengine.executor import Executor
    from mpengine.executor.tensor_parallel import RankGroup

logger = logging.getLogger(__name__)

POLL_S = 0.05
# How often (in steps) the other ranks' step breakdowns reach rank 0, which sends them on
# with its own (``mpengine stats``, ``top``, the metrics show every rank).
TIMES_EVERY = 64
_RANK_STAGE = re.compile(r"executor tp([1-9][0-9]*)")


def node_ranks(config: EngineConfig) -> range:
    """The ranks on this host."""
    first = config.node_rank * config.ranks_per_node
    return range(first, first + config.ranks_per_node)


def rank_stages(config: EngineConfig) -> tuple[str, ...]:
    """The stage names of this host's ranks but rank 0 (the executor stage)."""
    return tuple(f"executor tp{rank}" for rank in node_ranks(config) if rank > 0)


def dist_init(config: EngineConfig) -> str:
    """Where the ranks' process group meets: ``master_addr:master_port``, or on one host a
    free loopback port when no port is given."""
    if config.nnodes > 1 or config.master_port:
        return f"tcp://{config.master_addr}:{config.master_port}"
    return f"tcp://127.0.0.1:{free_port()}"


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
    size, local_rank = config.tensor_parallel_size, rank % config.ranks_per_node
    return RankGroup(rank, size, local_rank, device, wiring.dist_init, config.startup_timeout)


@contextlib.contextmanager
def plan_fan_out(config: EngineConfig, wiring: Wiring) -> Iterator[Callable[[Frame], None] | None]:
    """Rank 0's way to hand each plan frame on: to this host's other ranks (the rank ring)
    and to the other hosts' (``remote_plans``); None with one rank."""
    with contextlib.ExitStack() as stack:
        targets: list[Callable[[Frame], None]] = []
        if wiring.rank_ring:
            targets.append(stack.enter_context(Broadcast.writer(wiring.rank_ring)).put)
        if config.nnodes > 1:
            remote = config.tensor_parallel_size - config.ranks_per_node
            address = plan_address(config.master_addr, config.master_port)
            publisher = PlanPublisher(address, remote, config.auth_token, config.startup_timeout)
            stack.callback(publisher.close)
            targets.append(publisher.put)
        if len(targets) < 2:
            yield targets[0] if targets else None
            return

        def both(frame: Frame) -> None:
            for target in targets:
                target(frame)

        yield both


def run_rank(
    config: EngineConfig, wiring: Wiring, control: Control, stop: StopFlag, rank: int
) -> None:
    """A rank other than 0: joins the group, loads its part of the model, then runs every
    plan rank 0 broadcasts."""
    from mpengine.executor import create_executor

    with contextlib.ExitStack() as stack:
        plans: Broadcast | PlanSubscriber
        if config.node_rank > 0:  # subscribed before joining: ready when rank 0 looks
            address = plan_address(config.master_addr, config.master_port)
            plans = stack.enter_context(PlanSubscriber(address, config.auth_token))
        ranks = join_ranks(config, wiring, rank)
        assert ranks is not None and rank > 0
        executor = create_executor(config, ranks)
        if config.node_rank == 0:
            plans = stack.enter_context(Broadcast.reader(wiring.rank_ring, rank - 1))
        control.ready()
        rank_loop(executor, plans, stop, wiring.executor_generation, f"executor tp{rank}")


def rank_loop(
    executor: Executor,
    plans: Broadcast | PlanSubscriber,
    stop: StopFlag,
    generation: int,
    stage: str,
) -> None:
    """Run rank 0's plans as they come (those of this executor's generation)."""
    assert executor.ranks is not None
    decoder = plan_decoder()
    clock = Clock([stage])
    times = RankTimes(executor.ranks)
    while not stop:
        try:
            frame = plans.get(POLL_S)
        except TimeoutError:
            clock.idle()
            continue
        except PeerGone as exc:  # (rank 0 stopped first, or died: the engine is over)
            if not stop:
                logger.error("%s: this rank stops", exc)
            return
        clock.wait(stage, "plan_ring")
        plan: StepPlan = decoder.decode(frame)
        if plan.generation != generation:
            continue
        clock.begin_step(stage, plan.step)
        clock.work(stage, "decode")
        executor.execute(plan)
        clock.marks(stage, executor.marks)
        clock.end_step(stage)
        times.exchange(plan.step, clock)


class RankTimes:
    """Every ``TIMES_EVERY`` steps each rank sends rank 0 its totals (one gather)."""

    def __init__(self, ranks: RankGroup) -> None:
        self.ranks = ranks
        self.latest: dict[str, StageTimes] = {}  # on rank 0: the others', as last gathered

    def exchange(self, step: int, clock: Clock) -> dict[str, StageTimes]:
        if step % TIMES_EVERY == 0:
            own = encoder.encode(clock.snapshot()) if not self.ranks.driver else b""
            for part in self.ranks.gather(own)[1:]:
                self.latest.update(msgspec.msgpack.decode(part, type=dict[str, StageTimes]))
        return self.latest

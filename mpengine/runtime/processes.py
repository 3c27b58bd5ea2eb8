"""The product runtime: scheduler, executor and output processor as three processes.

    clients --ZMQ--> scheduler --plan ring--> executor --result ring--> output --ZMQ--> clients
                       ^  |                                              |
                       |  +------------------ announce ring ------------>|
                       +------------ feedback ring + lockstep counter ---+

The lockstep rule: ``done`` (the counter) is the highest step whose output processing and
feedback are complete; the output processor writes ``Feedback k`` and then advances the
counter to ``k``. The scheduler plans step ``s`` only once ``done >= s - 1 - async_depth``,
then drains the feedback ring, which by then holds every feedback up to ``done``. Nothing
else synchronises the three (besides empty rings).

The three loops (``*_loop``) see their peers only as :class:`Link`\\ s and a counter, so the
threads runtime runs the very same loops over in-process queues. Each loop charges its time
to a :class:`~mpengine.runtime.timing.Clock` as it goes (the step breakdown). Every wait is
bounded (``POLL_S``) so a stop signal is seen promptly.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol

import msgspec

from mpengine.config import EngineConfig
from mpengine.protocol import (
    Announcement,
    EngineInfo,
    ModelInfo,
    OutputDelta,
    Resync,
    Wiring,
    announcement_decoder,
    encoder,
    feedback_decoder,
    plan_decoder,
    result_decoder,
)
from mpengine.runtime.edges import REPLY_HWM, Edge
from mpengine.runtime.front import FrontDoor, OutputDoor
from mpengine.runtime.ranks import RankTimes, join_ranks, plan_fan_out
from mpengine.runtime.stage import Control, StopFlag
from mpengine.runtime.timing import EXECUTOR, OUTPUT, SCHEDULER, Clock, Trace
from shm import Lockstep, Ring

if TYPE_CHECKING:
    from mpengine.executor import Executor
    from mpengine.output import OutputProcessor
    from mpengine.scheduler import Scheduler

logger = logging.getLogger(__name__)

POLL_S = 0.05
GREETING_BYTES = 4096


def advertised(address: str, host: str | None) -> str:
    """``address`` with its host replaced by ``host`` (tcp only), for clients to connect to
    when the engine binds a wildcard."""
    if not host or not address.startswith("tcp://"):
        return address
    port = address.rsplit(":", 1)[1]
    host = f"[{host}]" if ":" in host and not host.startswith("[") else host
    return f"tcp://{host}:{port}"


# What EngineInfo takes as it is from the model's info and from the config.
_INFO_FROM_MODEL = (
    "vocab_size", "max_model_len", "block_size", "num_blocks", "eos_token_ids", "pooling",
    "can_generate", "sampling_defaults",
)  # fmt: skip
_INFO_FROM_CONFIG = (
    "engine_id", "max_num_seqs", "max_num_batched_tokens", "runtime", "async_depth",
    "max_request_bytes", "max_waiting_requests", "max_waiting_tokens",
)  # fmt: skip


def engine_info(config: EngineConfig, model: ModelInfo, wiring: Wiring) -> EngineInfo:
    from mpengine import __version__

    return EngineInfo(
        model=model.model_path,
        tokenizer=model.tokenizer_path,
        request_address=advertised(wiring.request_address, config.advertise_host),
        output_address=advertised(wiring.output_address, config.advertise_host),
        version=__version__,
        **{name: getattr(model, name) for name in _INFO_FROM_MODEL},
        **{name: getattr(config, name) for name in _INFO_FROM_CONFIG},
    )


def request_edge(config: EngineConfig, wiring: Wiring) -> Edge:
    return Edge(
        wiring.request_address, config.max_request_bytes, REPLY_HWM, auth_token=config.auth_token
    )


def output_edge(config: EngineConfig, wiring: Wiring) -> Edge:
    """Clients only greet this edge: small frames in, their outputs out."""
    return Edge(wiring.output_address, GREETING_BYTES, config.client_send_hwm, config.auth_token)


# -- what connects the loops ---------------------------------------------------------------


class Link:
    """One direction between two stage loops, read and written like a ring: ``put(frame)``,
    ``get_view(timeout)`` (a context manager yielding the next frame; TimeoutError when none
    comes), ``try_get()`` (a frame or None). ``encode`` / ``decode`` turn messages into
    frames and back: msgpack over a shm ring here, nothing at all over the threads
    runtime's queues, whose frames are the messages themselves.

    The attributes are the ring's own bound methods, not wrappers: a read stays one call.
    """

    __slots__ = ("close", "decode", "encode", "get_view", "put", "try_get")

    def __init__(
        self,
        put: Callable[[Any], None],
        get_view: Callable[[float], contextlib.AbstractContextManager[Any]],
        try_get: Callable[[], Any],
        encode: Callable[[Any], Any],
        decode: Callable[[Any], Any],
        close: Callable[[], None],
    ) -> None:
        self.put = put
        self.get_view = get_view
        self.try_get = try_get
        self.encode = encode
        self.decode = decode
        self.close = close

    @classmethod
    def ring(cls, name: str, decoder: msgspec.msgpack.Decoder | None = None) -> Link:
        """Attach the ring ``name``; its reader passes the decoder of its messages."""
        ring = Ring.attach(name)
        decode = decoder.decode if decoder is not None else _not_read_here
        return cls(ring.put, ring.get_view, ring.try_get, encoder.encode, decode, ring.close)


def _not_read_here(frame: object) -> object:
    raise RuntimeError("this side of the ring only writes")


class Counter(Protocol):
    """The lockstep counter as the loops use it (``shm.Lockstep``, or ``threads.Counter``)."""

    @property
    def value(self) -> int: ...

    def wait_at_least(self, k: int, timeout: float | None = None) -> int: ...

    def advance_to(self, k: int) -> None: ...


@dataclass(slots=True)
class Links:
    """What a stage loop sees of its peers: the four links (each loop uses those of its
    stage; a process attaches only those, the others stay :data:`NO_LINK`) and the lockstep
    counter."""

    done: Counter
    plans: Link = field(default_factory=lambda: NO_LINK)
    results: Link = field(default_factory=lambda: NO_LINK)
    announces: Link = field(default_factory=lambda: NO_LINK)
    feedbacks: Link = field(default_factory=lambda: NO_LINK)

    def close(self) -> None:
        for link in (self.plans, self.results, self.announces, self.feedbacks):
            link.close()
        close = getattr(self.done, "close", None)  # (shm.Lockstep; a thread's has none)
        if close is not None:
            close()


def _no_link(*args: object) -> Any:
    raise RuntimeError("this stage has no such link")


NO_LINK = Link(_no_link, _no_link, _no_link, _no_link, _no_link, lambda: None)


# -- the three loops -----------------------------------------------------------------------


def scheduler_loop(
    scheduler: Scheduler, front: FrontDoor, links: Links, lag: int, clock: Clock, stop: StopFlag
) -> None:
    plans, announces, feedbacks, done = links.plans, links.announces, links.feedbacks, links.done
    generation = 0  # of the output processor announced to
    while not stop:
        if (asked := type(scheduler).executor_losses) != scheduler.executor_generation:
            # the executor was restarted
            after_restart(scheduler, links, partial(scheduler.lose_executor, asked, generation))
        if (asked := type(scheduler).resyncs_asked) != generation:  # the output processor
            generation = asked
            after_restart(scheduler, links, partial(scheduler.resync, generation))
        # 1. requests and aborts (wait for them only when there is nothing else to do)
        in_flight = scheduler.done < scheduler.next_step - 1
        idle = not scheduler.has_unfinished and not in_flight
        front.serve(POLL_S if idle else 0.0)
        if idle:
            clock.idle()
        else:
            clock.work(SCHEDULER, "serve")
        for announcement in scheduler.take_announcements():  # aborts of queued requests
            announces.put(announces.encode(announcement))
        if not scheduler.has_unfinished and not in_flight:
            continue
        # 2. the lockstep rule: plan step s once done >= s - 1 - lag; by then the ring
        # holds every feedback up to done. With nothing to plan, just catch up.
        target = scheduler.next_step - 1 - lag if scheduler.has_unfinished else scheduler.done + 1
        try:
            done.wait_at_least(target, POLL_S)
        except TimeoutError:
            clock.wait(SCHEDULER, "lockstep")
            continue
        ready = clock.wait(SCHEDULER, "lockstep")
        feedback = []
        while (frame := feedbacks.try_get()) is not None:
            feedback.append(feedbacks.decode(frame))
            clock.hear(feedback[-1].times)
        clock.work(SCHEDULER, "feedback")
        # 3. plan; announcements go out before the plan that needs them
        plan = scheduler.schedule(feedback)
        clock.work(SCHEDULER, "schedule")
        frames = [announces.encode(a) for a in scheduler.take_announcements()]
        plan_frame = plans.encode(plan) if plan is not None else None
        clock.work(SCHEDULER, "encode")
        for frame in frames:
            announces.put(frame)
        clock.wait(SCHEDULER, "announce_ring")
        if plan is not None:
            plans.put(plan_frame)
            clock.wait(SCHEDULER, "plan_ring")
            clock.begin_step(SCHEDULER, plan.step, start=ready)
            clock.end_step(SCHEDULER)
        elif scheduler.done < scheduler.next_step - 1:
            # Nothing to plan until a step in flight reports back.
            with contextlib.suppress(TimeoutError):
                done.wait_at_least(scheduler.done + 1, POLL_S)
            clock.wait(SCHEDULER, "lockstep")
        elif scheduler.has_unfinished:
            front.serve(POLL_S)  # blocked on something only a client can change
            clock.idle()


def after_restart(scheduler: Scheduler, links: Links, carry_on: Callable[[], None]) -> None:
    """A stage was restarted: apply every feedback left in the ring (all that a dead output
    processor wrote; of a dead executor's results, all: the launcher waited for the output
    processor to take the last), then ``carry_on()`` (``Scheduler.resync``, or
    ``.lose_executor``), and send the announcements it makes."""
    feedbacks, announces = links.feedbacks, links.announces
    while (frame := feedbacks.try_get()) is not None:
        scheduler.apply_feedback(feedbacks.decode(frame))
    carry_on()
    for announcement in scheduler.take_announcements():
        announces.put(announces.encode(announcement))


def executor_loop(
    executor: Executor,
    links: Links,
    clock: Clock,
    stop: StopFlag,
    generation: int = 0,
    fan_out: Callable[[memoryview], None] | None = None,
) -> None:
    """``fan_out``: where each plan frame goes on to the other tensor-parallel ranks."""
    plans, results, done = links.plans, links.results, links.done
    rank_times = RankTimes(executor.ranks) if executor.ranks is not None else None
    last_step = 0
    while not stop:
        # 1. the next plan (the counter is only read, for the breakdown: until every step
        # computed here is fed back, the executor waits on its peers, not on clients)
        try:
            with plans.get_view(POLL_S) as frame:
                clock.wait(EXECUTOR, "plan_ring")
                if fan_out is not None:
                    fan_out(frame)
                plan = plans.decode(frame)
            if plan.generation != generation:
                continue  # planned for a predecessor that died: its steps are lost
        except TimeoutError:
            if done.value < last_step:
                clock.wait(EXECUTOR, "plan_ring")
            else:
                clock.idle()
            continue
        last_step = plan.step
        clock.begin_step(EXECUTOR, plan.step)
        clock.work(EXECUTOR, "decode")
        # 2. forward + sample (the executor marks its own phases)
        result = executor.execute(plan)
        clock.marks(EXECUTOR, executor.marks)
        # 3. hand the result on, with this stage's totals (and the other ranks')
        result.times = clock.snapshot()
        if rank_times is not None:
            result.times |= rank_times.exchange(plan.step, clock)
        frame = results.encode(result)
        clock.work(EXECUTOR, "encode")
        results.put(frame)
        clock.wait(EXECUTOR, "result_ring")
        clock.end_step(EXECUTOR)


class Announced:
    """The announce ring as the output processor reads it. A restarted one learns every
    request from the scheduler (the ``Resync`` of its generation; one for a predecessor
    that died starting is stale) before it reads a result: ``awaiting`` until then."""

    def __init__(self, processor: OutputProcessor, links: Links, generation: int) -> None:
        self.processor = processor
        self.announces, self.done = links.announces, links.done
        self.generation = generation
        self.awaiting = generation > 0

    def take(self, msg: Announcement) -> list[tuple[str, OutputDelta]]:
        if isinstance(msg, Resync) and msg.generation != self.generation:
            return []
        deltas = self.processor.announce(msg)
        if isinstance(msg, Resync) and msg.last:
            self.awaiting = False
            if msg.done > self.done.value:  # (fed back, but the counter was not moved yet)
                self.done.advance_to(msg.done)
        return deltas

    def drain(self) -> list[tuple[str, OutputDelta]]:
        """Every announcement waiting now."""
        deltas = []
        while (frame := self.announces.try_get()) is not None:
            deltas += self.take(self.announces.decode(frame))
        return deltas

    def next(self, timeout: float) -> list[tuple[str, OutputDelta]]:
        """The next announcement, waiting up to ``timeout`` for it."""
        try:
            with self.announces.get_view(timeout) as frame:
                msg = self.announces.decode(frame)
        except TimeoutError:
            return []
        return self.take(msg)


def output_loop(
    processor: OutputProcessor,
    door: OutputDoor,
    links: Links,
    clock: Clock,
    stop: StopFlag,
    generation: int = 0,
) -> None:
    results, feedbacks, done = links.results, links.feedbacks, links.done
    announced = Announced(processor, links, generation)
    while not stop:
        # 1. client greetings; announcements that need no step (aborts of queued requests)
        door.greet()
        door.send(announced.drain())
        clock.work(OUTPUT, "greet")
        if announced.awaiting:  # (restarted: every request comes first)
            door.send(announced.next(POLL_S))
            continue
        # 2. the next result (while a request is open, one is on its way: a wait, not idle)
        try:
            view = results.get_view(POLL_S)
        except TimeoutError:
            if processor.num_unfinished:
                clock.wait(OUTPUT, "result_ring")
            else:
                clock.idle()
            continue
        # The result stays in the ring until its feedback is out: if this process dies
        # before, its successor finds it there (one fed back already it skips).
        with view as frame:
            clock.wait(OUTPUT, "result_ring")
            result = results.decode(frame)
            if result.step <= done.value:
                continue
            clock.begin_step(OUTPUT, result.step)
            # 3. its announcements were written before its plan, so they are all here now
            deltas = announced.drain()
            feedback, step_deltas = processor.process(result)
            clock.work(OUTPUT, "process")
            # 4. the deltas, then the feedback (carrying the executor's totals and ours) and
            # the counter: what is fed back has been sent, so a successor replays from the
            # scheduler's tokens only what its client may lack.
            door.send(deltas + step_deltas)
            clock.work(OUTPUT, "send")
            feedback.times = {**result.times, **clock.snapshot()}
            frame = feedbacks.encode(feedback)
            clock.work(OUTPUT, "encode")
            feedbacks.put(frame)
            done.advance_to(result.step)
            clock.wait(OUTPUT, "feedback_ring")
        clock.end_step(OUTPUT)


# -- the three processes -------------------------------------------------------------------


def run_executor(config: EngineConfig, wiring: Wiring, control: Control, stop: StopFlag) -> None:
    from mpengine.executor import create_executor

    executor = create_executor(config, join_ranks(config, wiring, 0))
    links = Links(
        Lockstep.attach(wiring.lockstep),  # read, never waited on
        plans=Link.ring(wiring.plan_ring, plan_decoder()),
        results=Link.ring(wiring.result_ring),
    )
    with contextlib.ExitStack() as stack:
        fan_out = stack.enter_context(plan_fan_out(config, wiring))
        clock = stack.enter_context(_stage(config, EXECUTOR, links))
        control.ready(executor.info)
        executor_loop(executor, links, clock, stop, wiring.executor_generation, fan_out)


def run_scheduler(config: EngineConfig, wiring: Wiring, control: Control, stop: StopFlag) -> None:
    from mpengine.scheduler import Scheduler

    model = control.wait_model(config.startup_timeout, stop)
    if model is None:
        return
    scheduler = Scheduler.for_model(config, model)
    links = Links(
        Lockstep.attach(wiring.lockstep),
        plans=Link.ring(wiring.plan_ring),
        announces=Link.ring(wiring.announce_ring),
        feedbacks=Link.ring(wiring.feedback_ring, feedback_decoder()),
    )
    edge = request_edge(config, wiring)
    with _stage(config, SCHEDULER, links, edge) as clock:
        front = FrontDoor(edge, scheduler, engine_info(config, model, wiring), clock.report)
        control.ready()
        scheduler_loop(scheduler, front, links, config.async_depth, clock, stop)


def run_output(config: EngineConfig, wiring: Wiring, control: Control, stop: StopFlag) -> None:
    from mpengine.output import OutputProcessor

    model = control.wait_model(config.startup_timeout, stop)
    if model is None:
        return
    processor = OutputProcessor(model.tokenizer_path, model.eos_token_ids)
    links = Links(
        Lockstep.attach(wiring.lockstep),
        results=Link.ring(wiring.result_ring, result_decoder()),
        announces=Link.ring(wiring.announce_ring, announcement_decoder()),
        feedbacks=Link.ring(wiring.feedback_ring),
    )
    edge = output_edge(config, wiring)
    with _stage(config, OUTPUT, links, edge) as clock:
        door = OutputDoor(edge, processor, config, restarted=wiring.clients_returning)
        control.ready()
        output_loop(processor, door, links, clock, stop, wiring.output_generation)


@contextlib.contextmanager
def _stage(
    config: EngineConfig, stage: str, links: Links, edge: Edge | None = None
) -> Iterator[Clock]:
    """A stage process's clock (with ``--trace``, its trace written at the end); its links
    and client edge closed on the way out, however the loop ends."""
    trace = Trace.open(config.trace, stage)
    try:
        yield Clock([stage], trace)
    finally:
        if edge is not None:
            edge.close()
        links.close()
        if trace is not None:
            trace.write()

"""The threads runtime: the three stage loops as threads of one process.

This is the design of the engine mpengine replaces (vLLM runs its scheduler, executor and
output handling as threads of one process): the very loops of the processes runtime
(``processes.scheduler_loop`` ...), connected by in-process queues that carry the messages
themselves (nothing is encoded) and a counter under a condition variable, with the same
lockstep rule and the same ZMQ edges, so clients cannot tell it apart. It exists to be
measured beside the processes runtime: whatever the three threads cannot overlap, because
Python runs one of them at a time (the GIL), shows in its step breakdown and throughput.

A loop that raises stops the other two; the process then fails like any stage.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

import setproctitle

from mpengine.config import EngineConfig
from mpengine.protocol import Wiring
from mpengine.runtime.front import FrontDoor, OutputDoor
from mpengine.runtime.processes import (
    POLL_S,
    Link,
    Links,
    engine_info,
    executor_loop,
    output_edge,
    output_loop,
    request_edge,
    scheduler_loop,
)
from mpengine.runtime.stage import Control, StopFlag
from mpengine.runtime.timing import EXECUTOR, OUTPUT, SCHEDULER, Clock, Trace

logger = logging.getLogger(__name__)

JOIN_S = 10.0  # how long a stopped loop may take to notice (its waits last POLL_S)


class Counter:
    """The lockstep counter between threads, with ``shm.Lockstep``'s interface: one writer
    (the output thread) advances it, the scheduler thread waits on it."""

    def __init__(self) -> None:
        self.value = 0
        self._changed = threading.Condition()

    def advance_to(self, k: int) -> None:
        with self._changed:
            if k < self.value:
                raise ValueError(f"the lockstep counter cannot go back from {self.value} to {k}")
            self.value = k
            self._changed.notify_all()

    def wait_at_least(self, k: int, timeout: float | None = None) -> int:
        with self._changed:
            if not self._changed.wait_for(lambda: self.value >= k, timeout):
                raise TimeoutError(f"the lockstep counter is at {self.value}, not yet {k}")
            return self.value


class _Queue:
    """An unbounded in-process channel read like a ring. Unbounded is safe: the lockstep
    rule keeps at most ``async_depth + 1`` plans, results and feedbacks in flight."""

    def __init__(self) -> None:
        self.queue: queue.SimpleQueue[Any] = queue.SimpleQueue()

    def get_view(self, timeout: float) -> contextlib.nullcontext[Any]:
        try:
            return contextlib.nullcontext(self.queue.get(timeout=timeout))
        except queue.Empty:
            raise TimeoutError("empty") from None

    def try_get(self) -> Any:
        try:
            return self.queue.get_nowait()
        except queue.Empty:
            return None


def queue_link() -> Link:
    """A link whose frames are the messages themselves."""
    channel = _Queue()
    return Link(channel.queue.put, channel.get_view, channel.try_get, _same, _same, _nothing)


def _same(msg: Any) -> Any:
    return msg


def _nothing() -> None:
    return None


def run_threads(config: EngineConfig, wiring: Wiring, control: Control, stop: StopFlag) -> None:
    from mpengine.executor import create_executor
    from mpengine.output import OutputProcessor
    from mpengine.scheduler import Scheduler

    executor = create_executor(config)
    model = executor.info
    scheduler = Scheduler.for_model(config, model)
    processor = OutputProcessor(model.tokenizer_path, model.eos_token_ids)
    links = Links(Counter(), *(queue_link() for _ in range(4)))
    trace = Trace.open(config.trace, "engine")  # one ring, appended to by every thread
    clocks = {stage: Clock([stage], trace) for stage in (SCHEDULER, EXECUTOR, OUTPUT)}
    # Each edge is created here and then used by its loop's thread alone (ZMQ sockets may
    # move between threads; starting a thread is the barrier that makes the move safe).
    requests = request_edge(config, wiring)
    outputs = output_edge(config, wiring)
    info = engine_info(config, model, wiring)
    front = FrontDoor(requests, scheduler, info, clocks[SCHEDULER].report)
    door = OutputDoor(outputs, processor, config)
    loops: dict[str, Callable[[], None]] = {
        SCHEDULER: lambda: scheduler_loop(
            scheduler, front, links, config.async_depth, clocks[SCHEDULER], stop
        ),
        EXECUTOR: lambda: executor_loop(executor, links, clocks[EXECUTOR], stop),
        OUTPUT: lambda: output_loop(processor, door, links, clocks[OUTPUT], stop),
    }
    failures: list[BaseException] = []

    def run(stage: str) -> None:
        setproctitle.setthreadtitle(f"mpe:{stage}")
        try:
            loops[stage]()
        except BaseException as exc:
            logger.exception("the %s thread failed: stopping the engine", stage)
            failures.append(exc)
            stop.set()

    threads = [threading.Thread(target=run, args=(stage,), name=stage) for stage in loops]
    control.ready(model)
    try:
        for thread in threads:
            thread.start()
        # The main thread only waits: it is the one Python runs signal handlers in.
        while any(thread.is_alive() for thread in threads):
            for thread in threads:
                thread.join(POLL_S)
    finally:
        stop.set()
        for thread in threads:
            if thread.ident is not None:
                thread.join(JOIN_S)
        requests.close()
        outputs.close()
        if trace is not None:
            trace.write()
    if failures:
        raise failures[0]

"""The serial runtime: the same three stages in one process and one loop.

For debugging, for tests, and as the honest baseline of the benchmarks: it pays for every
stage's Python in turn, which is what the processes runtime exists to overlap. It has the
same ZMQ edges, so clients cannot tell the two apart. Its stages share the loop's wall
time in the step breakdown: what one stage is not busy with, it waits for the others.
"""

from __future__ import annotations

import logging

from mpengine.config import EngineConfig
from mpengine.protocol import Wiring
from mpengine.runtime.front import FrontDoor, OutputDoor
from mpengine.runtime.processes import (
    POLL_S,
    engine_info,
    output_edge,
    request_edge,
)
from mpengine.runtime.stage import Control, StopFlag
from mpengine.runtime.timing import EXECUTOR, OUTPUT, SCHEDULER, STAGES, Clock, Trace

logger = logging.getLogger(__name__)


def run_serial(config: EngineConfig, wiring: Wiring, control: Control, stop: StopFlag) -> None:
    from mpengine.executor import create_executor
    from mpengine.output import OutputProcessor
    from mpengine.scheduler import Scheduler

    executor = create_executor(config)
    model = executor.info
    scheduler = Scheduler.for_model(config, model)
    processor = OutputProcessor(model.tokenizer_path, model.eos_token_ids)
    trace = Trace.open(config.trace, "engine")
    clock = Clock(STAGES, trace)
    requests = request_edge(config, wiring)
    outputs = output_edge(config, wiring)
    front = FrontDoor(requests, scheduler, engine_info(config, model, wiring), clock.report)
    door = OutputDoor(outputs, processor, config)
    control.ready(model)
    try:
        while not stop:
            # 1. requests; greetings on the output edge
            idle = not scheduler.has_unfinished
            front.serve(POLL_S if idle else 0.0)
            if idle:
                clock.idle()
            else:
                clock.work(SCHEDULER, "serve")
            door.greet()
            started = clock.work(OUTPUT, "greet")
            # 2. schedule
            plan = scheduler.schedule()
            clock.work(SCHEDULER, "schedule")
            if plan is not None:
                clock.begin_step(SCHEDULER, plan.step, start=started)
                clock.end_step(SCHEDULER)
            deltas = []
            for announcement in scheduler.take_announcements():
                deltas += processor.announce(announcement)
            clock.work(OUTPUT, "announce")
            # 3. execute, 4. process: one after the other
            if plan is not None:
                clock.begin_step(EXECUTOR, plan.step)
                result = executor.execute(plan)
                clock.marks(EXECUTOR, executor.marks)
                clock.end_step(EXECUTOR)
                clock.begin_step(OUTPUT, plan.step)
                step_feedback, step_deltas = processor.process(result)
                clock.work(OUTPUT, "process")
                # Before the outputs go: whoever reads the engine's stats after them finds
                # this step done (they lagged a step behind the outputs).
                scheduler.apply_feedback(step_feedback)
                clock.work(SCHEDULER, "feedback")
                deltas += step_deltas
            # 5. stream
            door.send(deltas)
            clock.work(OUTPUT, "send")
            clock.end_step(OUTPUT)
    finally:
        requests.close()
        outputs.close()
        if trace is not None:
            trace.write()

"""The serial runtime: the same three stages in one process and one loop.

For debugging, for tests, and as the honest baseline of the benchmarks: it pays for every
stage's Python in turn, which is what the processes runtime exists to overlap. It has the
same ZMQ edges, so clients cannot tell the two apart.
"""

from __future__ import annotations

import logging

from mpengine.config import EngineConfig
from mpengine.protocol import Wiring
from mpengine.runtime.front import FrontDoor, OutputDoor
from mpengine.runtime.processes import (
    POLL_S,
    engine_info,
    model_info,
    output_edge,
    request_edge,
)
from mpengine.runtime.stage import Control, StopFlag

logger = logging.getLogger(__name__)


def run_serial(config: EngineConfig, wiring: Wiring, control: Control, stop: StopFlag) -> None:
    from mpengine.executor import Executor
    from mpengine.output import OutputProcessor
    from mpengine.scheduler import Scheduler

    executor = Executor(config)
    model = model_info(config, executor)
    scheduler = Scheduler(config, model.num_blocks, model.vocab_size, model.max_model_len)
    processor = OutputProcessor(model.tokenizer_path, model.eos_token_ids)
    requests = request_edge(config, wiring)
    outputs = output_edge(config, wiring)
    front = FrontDoor(requests, scheduler, engine_info(config, model, wiring))
    door = OutputDoor(outputs, processor, config)
    feedback = []
    control.ready(model)
    try:
        while not stop:
            # 1. requests; greetings on the output edge
            front.serve(0.0 if scheduler.has_unfinished else POLL_S)
            door.greet()
            # 2. schedule, 3. execute, 4. process: one after the other
            plan = scheduler.schedule(feedback)
            feedback = []
            deltas = []
            for announcement in scheduler.take_announcements():
                deltas += processor.announce(announcement)
            if plan is not None:
                result = executor.execute(plan)
                step_feedback, step_deltas = processor.process(result)
                feedback.append(step_feedback)
                deltas += step_deltas
            # 5. stream
            door.send(deltas)
    finally:
        requests.close()
        outputs.close()

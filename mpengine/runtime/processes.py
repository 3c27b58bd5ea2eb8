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

Every wait is bounded (``POLL_S``) so a stop signal is seen promptly.
"""

from __future__ import annotations

import contextlib
import logging

from mpengine.config import EngineConfig
from mpengine.protocol import (
    EngineInfo,
    ModelInfo,
    OutputDelta,
    Wiring,
    announcement_decoder,
    encoder,
    feedback_decoder,
    plan_decoder,
    result_decoder,
)
from mpengine.runtime.edges import Edge
from mpengine.runtime.front import FrontDoor, OutputDoor
from mpengine.runtime.stage import Control, StopFlag
from shm import Lockstep, Ring

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


def engine_info(config: EngineConfig, model: ModelInfo, wiring: Wiring) -> EngineInfo:
    from mpengine import __version__

    return EngineInfo(
        engine_id=config.engine_id,
        model=model.model_path,
        tokenizer=model.tokenizer_path,
        vocab_size=model.vocab_size,
        max_model_len=model.max_model_len,
        block_size=model.block_size,
        num_blocks=model.num_blocks,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        eos_token_ids=model.eos_token_ids,
        runtime=config.runtime,
        async_depth=config.async_depth,
        request_address=advertised(wiring.request_address, config.advertise_host),
        output_address=advertised(wiring.output_address, config.advertise_host),
        max_request_bytes=config.max_request_bytes,
        version=__version__,
    )


def request_edge(config: EngineConfig, wiring: Wiring) -> Edge:
    """Replies (errors, stats) to a client that does not read them are dropped past
    ``client_send_hwm``, never buffered without bound."""
    return Edge(
        wiring.request_address,
        config.max_request_bytes,
        config.client_send_hwm,
        config.auth_token,
    )


def output_edge(config: EngineConfig, wiring: Wiring) -> Edge:
    """Clients only greet this edge: small frames in, their outputs out."""
    return Edge(wiring.output_address, GREETING_BYTES, config.client_send_hwm, config.auth_token)


def model_info(config: EngineConfig, executor) -> ModelInfo:
    info = executor.info
    return ModelInfo(
        model_path=info.model_path,
        tokenizer_path=config.tokenizer or info.model_path,
        vocab_size=info.vocab_size,
        max_model_len=info.max_model_len,
        num_blocks=info.num_blocks,
        block_size=info.block_size,
        eos_token_ids=list(info.eos_token_ids),
        kv_cache_bytes=info.kv_cache_bytes,
        device=str(info.device),
        dtype=str(info.dtype),
        num_threads=info.num_threads,
    )


def run_executor(config: EngineConfig, wiring: Wiring, control: Control, stop: StopFlag) -> None:
    from mpengine.executor import Executor

    executor = Executor(config)
    plans = Ring.attach(wiring.plan_ring)
    results = Ring.attach(wiring.result_ring)
    decoder = plan_decoder()
    control.ready(model_info(config, executor))
    try:
        while not stop:
            # 1. the next plan
            try:
                with plans.get_view(POLL_S) as frame:
                    plan = decoder.decode(frame)
            except TimeoutError:
                continue
            # 2. forward + sample, 3. hand the result on
            result = executor.execute(plan)
            results.put(encoder.encode(result))
    finally:
        plans.close()
        results.close()


def run_scheduler(config: EngineConfig, wiring: Wiring, control: Control, stop: StopFlag) -> None:
    from mpengine.scheduler import Scheduler

    model = control.wait_model(config.startup_timeout)
    scheduler = Scheduler(config, model.num_blocks, model.vocab_size, model.max_model_len)
    plans = Ring.attach(wiring.plan_ring)
    announces = Ring.attach(wiring.announce_ring)
    feedbacks = Ring.attach(wiring.feedback_ring)
    done = Lockstep.attach(wiring.lockstep)
    edge = request_edge(config, wiring)
    front = FrontDoor(edge, scheduler, engine_info(config, model, wiring))
    decoder = feedback_decoder()
    lag = config.async_depth
    control.ready()
    try:
        while not stop:
            # 1. requests and aborts (wait for them only when there is nothing else to do)
            in_flight = scheduler.done < scheduler.next_step - 1
            front.serve(0.0 if scheduler.has_unfinished or in_flight else POLL_S)
            for announcement in scheduler.take_announcements():  # aborts of queued requests
                announces.put(encoder.encode(announcement))
            if not scheduler.has_unfinished and not in_flight:
                continue
            # 2. the lockstep rule: plan step s once done >= s - 1 - lag; by then the ring
            # holds every feedback up to done. With nothing to plan, just catch up.
            if scheduler.has_unfinished:
                target = scheduler.next_step - 1 - lag
            else:
                target = scheduler.done + 1
            try:
                done.wait_at_least(target, POLL_S)
            except TimeoutError:
                continue
            feedback = []
            while (frame := feedbacks.try_get()) is not None:
                feedback.append(decoder.decode(frame))
            # 3. plan; announcements go out before the plan that needs them
            plan = scheduler.schedule(feedback)
            for announcement in scheduler.take_announcements():
                announces.put(encoder.encode(announcement))
            if plan is not None:
                plans.put(encoder.encode(plan))
            elif scheduler.done < scheduler.next_step - 1:
                # Nothing to plan until a step in flight reports back.
                with contextlib.suppress(TimeoutError):
                    done.wait_at_least(scheduler.done + 1, POLL_S)
            elif scheduler.has_unfinished:
                front.serve(POLL_S)  # blocked on something only a client can change
    finally:
        edge.close()
        for ring in (plans, announces, feedbacks):
            ring.close()
        done.close()


def run_output(config: EngineConfig, wiring: Wiring, control: Control, stop: StopFlag) -> None:
    from mpengine.output import OutputProcessor

    model = control.wait_model(config.startup_timeout)
    processor = OutputProcessor(model.tokenizer_path, model.eos_token_ids)
    results = Ring.attach(wiring.result_ring)
    announces = Ring.attach(wiring.announce_ring)
    feedbacks = Ring.attach(wiring.feedback_ring)
    done = Lockstep.attach(wiring.lockstep)
    edge = output_edge(config, wiring)
    door = OutputDoor(edge, processor, config)
    announcement = announcement_decoder()
    result_of = result_decoder()

    def drain_announcements() -> list[tuple[str, OutputDelta]]:
        deltas = []
        while (frame := announces.try_get()) is not None:
            deltas += processor.announce(announcement.decode(frame))
        return deltas

    control.ready()
    try:
        while not stop:
            # 1. client greetings; announcements that need no step (aborts of queued requests)
            door.greet()
            door.send(drain_announcements())
            # 2. the next result
            try:
                with results.get_view(POLL_S) as frame:
                    result = result_of.decode(frame)
            except TimeoutError:
                continue
            # 3. its announcements were written before its plan, so they are all here now
            deltas = drain_announcements()
            feedback, step_deltas = processor.process(result)
            # 4. feedback, then the counter: the scheduler may now plan on this step
            feedbacks.put(encoder.encode(feedback))
            done.advance_to(result.step)
            # 5. stream the deltas
            door.send(deltas + step_deltas)
    finally:
        edge.close()
        for ring in (results, announces, feedbacks):
            ring.close()
        done.close()

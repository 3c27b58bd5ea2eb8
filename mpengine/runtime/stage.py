"""The entry point of every stage process: title, signals, logging, start-up handshake.

The launcher runs ``main()`` in a fresh interpreter (``python -c``, with the caller's cwd
removed from ``sys.path`` first, see ``launch.STAGE_ENTRY``) and sends it the resolved
config and its wiring as msgpack bytes over one end of a socketpair. The stage answers
``StageReady`` (or ``StageFailed`` with the reason) when it can serve; an address in use
says so plainly. Stages that need the model's facts (block count, tokenizer) wait for a
``ModelInfo`` the launcher relays from the executor. A stage is SIGKILLed when the launcher
dies (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import faulthandler
import logging
import os
import signal
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection

import msgspec
import setproctitle
import zmq

from mpengine.config import EngineConfig
from mpengine.protocol import ModelInfo, StageFailed, StageReady, Wiring, control_decoder, encoder

logger = logging.getLogger("mpengine.runtime.stage")  # also when run as __main__

PR_SET_PDEATHSIG = 1
# What the launcher and ``mpengine stacks`` send a stage (see ``Engine.drain``).
DRAIN_SIGNAL = signal.SIGUSR1  # scheduler: refuse new requests, let admitted ones finish
ABORT_SIGNAL = signal.SIGRTMIN  # scheduler: abort every unfinished request (queued, not merged)
STACKS_SIGNAL = signal.SIGUSR2  # any stage: dump every thread's Python stack (faulthandler)
STOP_SIGNAL = signal.SIGRTMIN + 1  # any stage: stop (what the launcher sends)


STOP_POLL_S = 0.05  # how often a stage waiting to start looks at its stop flag


class StopFlag:
    """Set by ``STOP_SIGNAL``; loops check it between waits (every wait is bounded)."""

    def __init__(self) -> None:
        self.event = threading.Event()

    def __bool__(self) -> bool:
        return self.event.is_set()

    def set(self, *_: object) -> None:
        self.event.set()


class Control:
    """The stage's side of the start-up pipe."""

    def __init__(self, stage: str, conn: Connection) -> None:
        self.stage = stage
        self.conn = conn
        self.decoder = control_decoder()
        self.started = False  # ready() was sent

    def ready(self, model: ModelInfo | None = None) -> None:
        self.conn.send_bytes(encoder.encode(StageReady(self.stage, os.getpid(), model)))
        self.started = True

    def failed(self, message: str) -> None:
        with contextlib.suppress(OSError):
            self.conn.send_bytes(encoder.encode(StageFailed(self.stage, message)))

    def wait_model(self, timeout: float, stop: StopFlag) -> ModelInfo | None:
        """The executor's model info, relayed by the launcher; None if the stage is stopped
        first (a failed start: the launcher does not wait out the rest of the timeout)."""
        deadline = time.monotonic() + timeout
        while not self.conn.poll(min(STOP_POLL_S, max(0.0, deadline - time.monotonic()))):
            if stop:
                return None
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{self.stage}: no model info from the launcher in {timeout} s")
        msg = self.decoder.decode(self.conn.recv_bytes())
        if not isinstance(msg, ModelInfo):
            raise RuntimeError(f"{self.stage}: expected ModelInfo, got {type(msg).__name__}")
        return msg


def _die_with_parent(parent_pid: int) -> None:
    """Ask the kernel to SIGKILL this stage if the launcher dies first. "The launcher" is the
    thread that forked this process, hence the launcher's long-lived spawner thread."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:  # it died before the request took effect
        os._exit(1)


def configure_logging(level: str, stage: str) -> None:
    logging.basicConfig(
        level=level,
        format=f"%(asctime)s %(levelname)s mpengine.{stage}[%(process)d] %(name)s: %(message)s",
        stream=sys.stderr,
        force=True,
    )


def install_signals(stage: str, stop: StopFlag, runtime_dir: str | None, parent_pid: int) -> None:
    """The launcher stops the stage with ``STOP_SIGNAL``. Ctrl-C, and SIGTERM from
    ``timeout``, ``kill -- -PGID`` or a service manager, reach the launcher's whole process
    group: the launcher decides (``mpengine serve`` drains first) and stops the stages, so
    while it lives a stage leaves SIGINT and SIGTERM to it (a stage dies with its launcher
    anyway). The scheduler obeys the drain signals (``Scheduler.draining``, ``.aborting``:
    checked at safe points of its loop, never acted on inside the handler). Every stage
    dumps its threads' stacks into ``RUNTIME_DIR/stacks-STAGE.txt`` on ``STACKS_SIGNAL``,
    even while stuck in C code."""

    def terminate(*_: object) -> None:
        if os.getppid() != parent_pid:  # the launcher is gone: nobody else will stop us
            stop.set()

    signal.signal(STOP_SIGNAL, stop.set)
    signal.signal(signal.SIGTERM, terminate)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if stage in ("scheduler", "engine"):
        from mpengine.scheduler import Scheduler

        def drain(*_: object) -> None:
            Scheduler.draining = True

        def abort(*_: object) -> None:
            Scheduler.draining = Scheduler.aborting = True

        signal.signal(DRAIN_SIGNAL, drain)
        signal.signal(ABORT_SIGNAL, abort)
    if runtime_dir:
        stacks = open(os.path.join(runtime_dir, f"stacks-{stage}.txt"), "a")  # noqa: SIM115
        faulthandler.register(STACKS_SIGNAL, file=stacks, all_threads=True)


def run_stage(
    stage: str, conn: Connection, parent_pid: int, runtime_dir: str | None = None
) -> None:
    """The body of every stage process; the launcher sends the config and wiring first."""
    _die_with_parent(parent_pid)
    setproctitle.setproctitle(f"mpengine: {stage}")
    setproctitle.setthreadtitle(f"mpe:{stage}")  # /proc/PID/comm holds 15 characters
    config_bytes, wiring_bytes = conn.recv_bytes(), conn.recv_bytes()
    config = EngineConfig.decode(config_bytes)
    wiring = msgspec.msgpack.decode(wiring_bytes, type=Wiring)
    configure_logging(config.log_level, stage)
    stop = StopFlag()
    install_signals(stage, stop, runtime_dir, parent_pid)
    control = Control(stage, conn)
    try:
        match stage:
            case "scheduler":
                from mpengine.runtime.processes import run_scheduler as run
            case "executor":
                from mpengine.runtime.processes import run_executor as run
            case "output":
                from mpengine.runtime.processes import run_output as run
            case "engine" if config.runtime == "threads":
                from mpengine.runtime.threads import run_threads as run
            case "engine":
                from mpengine.runtime.serial import run_serial as run
            case _:
                raise ValueError(f"unknown stage {stage!r}")
        run(config, wiring, control, stop)
    except BaseException as exc:
        if not control.started and isinstance(exc, ValueError | OSError | zmq.ZMQError):
            # What a user gave that cannot work (an unknown model, a missing file, a cache
            # too small, an address in use): the launcher reports it in one line; the
            # traceback is for --log-level DEBUG.
            logger.debug("%s cannot start:\n%s", stage, traceback.format_exc())
        else:
            logger.error("%s stopped by an error:\n%s", stage, traceback.format_exc())
        control.failed(failure_message(exc))
        raise SystemExit(1) from None
    logger.info("%s stopped", stage)


def failure_message(exc: BaseException) -> str:
    """What the launcher reports for a stage that failed to start."""
    message = f"{type(exc).__name__}: {exc}"
    if getattr(exc, "errno", None) == errno.EADDRINUSE:  # OSError or zmq.ZMQError
        # The usual cause: a second engine launched on the address of a running one.
        return f"address in use (is another engine or program bound to it?): {message}"
    return message


def main() -> None:
    """``python -c ... STAGE FD PPID [RUNTIME_DIR]``: run one stage (see
    ``launch.StageProcess``)."""
    runtime_dir = sys.argv[4] if len(sys.argv) > 4 else None
    run_stage(sys.argv[1], Connection(int(sys.argv[2])), int(sys.argv[3]), runtime_dir)


if __name__ == "__main__":
    main()

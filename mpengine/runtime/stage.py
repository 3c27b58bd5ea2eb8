"""What every stage process shares: its stop flag, its control pipe to the launcher
(start-up handshake), signals and logging. ``entry.py`` runs a stage with them.

A stage answers ``StageReady`` (or ``StageFailed`` with the reason) when it can serve.
Stages that need the model's facts (block count, tokenizer) wait for a ``ModelInfo`` the
launcher relays from the executor. A stage is SIGKILLed when the launcher dies
(``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import gc
import logging
import os
import signal
import sys
import threading
import time
from multiprocessing.connection import Connection

from mpengine.protocol import ModelInfo, StageFailed, StageReady, control_decoder, encoder

PR_SET_PDEATHSIG = 1
# What the launcher and ``mpengine stacks`` send a stage (see ``Engine.drain``).
DRAIN_SIGNAL = signal.SIGUSR1  # scheduler: refuse new requests, let admitted ones finish
ABORT_SIGNAL = signal.SIGRTMIN  # scheduler: abort every unfinished request (queued, not merged)
STACKS_SIGNAL = signal.SIGUSR2  # any stage: dump every thread's Python stack (faulthandler)
STOP_SIGNAL = signal.SIGRTMIN + 1  # any stage: stop (what the launcher sends)
RESYNC_SIGNAL = signal.SIGRTMIN + 2  # scheduler: the output processor was restarted
EXECUTOR_SIGNAL = signal.SIGRTMIN + 3  # scheduler: the executor died and restarts


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
        # What start-up allocated (modules, the model's Python objects: ~370k objects in the
        # executor) leaves the collector: a full collection walked it all, 0.2-0.6 s inside
        # some step. vLLM freezes likewise after start-up.
        gc.collect()
        gc.freeze()
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


def die_with_parent(parent_pid: int) -> None:
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
    anyway). The scheduler obeys the drain signals (``Scheduler.draining``, ``.aborting``)
    and the restarts of the output processor and the executor (``.resyncs_asked``,
    ``.executor_losses``), checked at safe points of its
    loop, never acted on inside the handler. Every stage
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

        def resync(*_: object) -> None:
            Scheduler.resyncs_asked += 1

        def executor_lost(*_: object) -> None:
            Scheduler.executor_losses += 1

        signal.signal(DRAIN_SIGNAL, drain)
        signal.signal(ABORT_SIGNAL, abort)
        signal.signal(RESYNC_SIGNAL, resync)
        signal.signal(EXECUTOR_SIGNAL, executor_lost)
    if runtime_dir:
        stacks = open(os.path.join(runtime_dir, f"stacks-{stage}.txt"), "a")  # noqa: SIM115
        faulthandler.register(STACKS_SIGNAL, file=stacks, all_threads=True)

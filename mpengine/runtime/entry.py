"""The entry point of every stage process: title, OpenMP defaults, handshake, dispatch.

The launcher runs ``main()`` in a fresh interpreter (``python -c``, with the caller's cwd
removed from ``sys.path`` first, see ``stage_process.STAGE_ENTRY``) and sends it the resolved
config and its wiring as msgpack bytes over one end of a socketpair; the stage then runs
its loop (``processes.py``, ``serial.py``, ``threads.py``) until stopped. A stage that
cannot start reports why in one line (an address in use says so plainly).
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import functools
import logging
import os
import sys
import traceback
from multiprocessing.connection import Connection

import msgspec
import setproctitle
import zmq

from mpengine.config import EngineConfig
from mpengine.protocol import Wiring
from mpengine.runtime.processes import run_executor, run_output, run_scheduler
from mpengine.runtime.ranks import rank_of, run_rank
from mpengine.runtime.serial import run_serial
from mpengine.runtime.stage import (
    Control,
    StopFlag,
    configure_logging,
    die_with_parent,
    install_signals,
)
from mpengine.runtime.threads import run_threads

logger = logging.getLogger("mpengine.runtime.entry")  # also when run as __main__

RUNS = {"scheduler": run_scheduler, "executor": run_executor, "output": run_output}

# How long an idle OpenMP worker of torch spins before it sleeps, in libgomp's spin
# iterations (its default, 300,000, is milliseconds of a busy core after every parallel
# region). The executor's workers would take that core from the scheduler and output
# stages (and the clients) between steps: on two cores, the tiny model's decode ran at
# 14.6k tok/s in the processes runtime with the default and at 17.4k with this, the
# serial runtime at 15.4k and 16.7k (tools/bench_engine.py, compiled decode steps). A
# short spin still covers the gaps between the operators of a forward pass. Set before
# torch loads libgomp; a user's OMP_WAIT_POLICY or GOMP_SPINCOUNT wins.
GOMP_SPINCOUNT = "10000"


def openmp_defaults() -> None:
    if "OMP_WAIT_POLICY" not in os.environ:
        os.environ.setdefault("GOMP_SPINCOUNT", GOMP_SPINCOUNT)


def run_stage(
    stage: str, conn: Connection, parent_pid: int, runtime_dir: str | None = None
) -> None:
    """The body of every stage process; the launcher sends the config and wiring first."""
    die_with_parent(parent_pid)
    setproctitle.setproctitle(f"mpengine: {stage}")
    comm = stage.replace("executor tp", "exec tp")  # /proc/PID/comm holds 15 characters
    setproctitle.setthreadtitle(f"mpe:{comm}")
    openmp_defaults()
    config_bytes, wiring_bytes = conn.recv_bytes(), conn.recv_bytes()
    config = EngineConfig.decode(config_bytes)
    stage_label = stage
    if config.data_parallel_size > 1:  # which replica's stage, for ps, stacks, top and logs
        stage_label = f"{stage} dp{config.data_parallel_rank}"
        setproctitle.setproctitle(f"mpengine: {stage_label}")
    if config.cuda_visible_devices is not None:  # (before anything imports torch)
        os.environ["CUDA_VISIBLE_DEVICES"] = config.cuda_visible_devices
    wiring = msgspec.msgpack.decode(wiring_bytes, type=Wiring)
    configure_logging(config.log_level, stage_label)
    stop = StopFlag()
    install_signals(stage, stop, runtime_dir, parent_pid)
    control = Control(stage, conn)
    try:
        if stage == "engine":
            run = run_threads if config.runtime == "threads" else run_serial
        elif stage in RUNS:
            run = RUNS[stage]
        elif (rank := rank_of(stage)) is not None:
            run = functools.partial(run_rank, rank=rank)
        else:
            raise ValueError(f"unknown stage {stage!r}")
        run(config, wiring, control, stop)
    except BaseException as exc:
        if not control.started and isinstance(
            exc, ValueError | OSError | zmq.ZMQError | MemoryError
        ):
            # What a user gave that cannot work (an unknown model, a missing file, a cache
            # too small or too large for the machine, an address in use): the launcher
            # reports it in one line; the traceback is for --log-level DEBUG.
            logger.debug("%s cannot start:\n%s", stage, traceback.format_exc())
        else:
            logger.error("%s stopped by an error:\n%s", stage, traceback.format_exc())
        control.failed(failure_message(exc))
        exit_now(1)
    logger.info("%s stopped", stage)
    exit_now()


def exit_now(status: int = 0) -> None:
    """Leave without the interpreter's teardown: the stage's work is done (or failed, its
    failure reported), and tearing down torch's and transformers' modules took 0.8 s of
    every engine shutdown (0.95 -> 0.14 s for the tiny model); a thread of the threads
    runtime still in a long call would hold it longer. Exit hooks run and streams are
    flushed first."""
    atexit._run_exitfuncs()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(status)


def failure_message(exc: BaseException) -> str:
    """What the launcher reports for a stage that failed to start."""
    message = f"{type(exc).__name__}: {exc}"
    if getattr(exc, "errno", None) == errno.EADDRINUSE:  # OSError or zmq.ZMQError
        # The usual cause: a second engine launched on the address of a running one.
        return f"address in use (is another engine or program bound to it?): {message}"
    return message


def main() -> None:
    """``python -c ... STAGE FD PPID [RUNTIME_DIR]``: run one stage (see
    ``runtime.stage_process.StageProcess``)."""
    runtime_dir = sys.argv[4] if len(sys.argv) > 4 else None
    run_stage(sys.argv[1], Connection(int(sys.argv[2])), int(sys.argv[3]), runtime_dir)


if __name__ == "__main__":
    main()

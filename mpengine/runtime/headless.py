"""``mpengine serve --headless``: an engine without the HTTP API (``run_engine``: for IPC
clients, and for a front elsewhere, ``mpengine serve --engine-address``, as vLLM's headless
data-parallel engines); or a host that runs only its share of an engine's tensor-parallel
ranks (``--node-rank`` above 0 of ``--nnodes``), as vLLM's headless nodes.

The engine itself (scheduler, output processor, rank 0 and node 0's other ranks) runs on
node 0; here each rank of this host is a stage process (``mpengine: executor tpN``) that
joins the process group at ``master_addr:master_port`` and takes the plans from rank 0
over ZMQ. Nothing else runs here: no shared memory, no client edge. The node lives as long
as its ranks: when one of them ends (rank 0 went away, a collective failed, it was
killed), the others are stopped and the command exits non-zero, for a service manager to
start it again with the engine.
"""

from __future__ import annotations

import logging
import shutil
import signal
import tempfile
import threading
import time
from multiprocessing.connection import wait

from mpengine.config import EngineConfig
from mpengine.errors import EngineStartError
from mpengine.protocol import StageFailed, StageReady, Wiring, control_decoder, encoder
from mpengine.runtime.ranks import dist_init, rank_stages
from mpengine.runtime.stage_process import StageProcess, halt

logger = logging.getLogger(__name__)

STOP_GRACE_S = 5.0


def run_engine(config: EngineConfig) -> int:
    """Run the engine (every replica of it) until SIGTERM / SIGINT (then drain) or its
    death; the exit status."""
    from mpengine.launch import Engine

    done, deaths = threading.Event(), []
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: done.set())
    try:
        engine = Engine(config)
    except EngineStartError as exc:
        logger.error("%s", exc)
        return 1
    try:
        engine.on_death(lambda reason: (deaths.append(reason), done.set()))
        model = engine.model.model_path if engine.model else config.model
        print(f"mpengine: serving {model} at {engine.address}", flush=True)
        done.wait()
        if deaths:
            return 1
        engine.shutdown(drain=True)
        return 0
    finally:
        engine.shutdown()


def run_headless(config: EngineConfig) -> int:
    """Run this host's ranks until one ends or SIGTERM / SIGINT, or (node 0, or no other
    node) the engine alone; the exit status."""
    if config.nnodes == 1 or config.node_rank == 0:
        return run_engine(config)
    stopping = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stopping.set())
    wiring = Wiring("", "", dist_init=dist_init(config))
    runtime_dir = tempfile.mkdtemp(prefix=f"mpengine-headless-{config.node_rank}-")
    procs: dict[str, StageProcess] = {}
    try:
        for stage in rank_stages(config):
            procs[stage] = proc = StageProcess(stage, runtime_dir)
            proc.conn.send_bytes(config.encode())
            proc.conn.send_bytes(encoder.encode(wiring))
        _wait_ready(procs, config.startup_timeout, stopping)
        logger.info(
            "node %d of %d: ranks %s ready, serving the engine at %s",
            config.node_rank,
            config.nnodes,
            ", ".join(procs),
            config.master_addr,
        )
        while not stopping.is_set():
            ended = wait([p.sentinel for p in procs.values()], 0.2)
            if ended:
                stage = next(s for s, p in procs.items() if p.sentinel == ended[0])
                logger.error("%s ended (exit code %s)", stage, procs[stage].exitcode)
                return 1
        return 0
    except EngineStartError as exc:
        logger.error("%s", exc)
        return 1
    finally:
        halt(list(procs.values()), STOP_GRACE_S)
        shutil.rmtree(runtime_dir, ignore_errors=True)


def _wait_ready(procs: dict[str, StageProcess], timeout: float, stopping: threading.Event) -> None:
    decoder = control_decoder()
    pending = dict(procs)
    deadline = time.monotonic() + timeout
    while pending and not stopping.is_set():
        if time.monotonic() > deadline:
            raise EngineStartError(f"ranks not ready within {timeout:g} s: {sorted(pending)}")
        waited = {p.conn: s for s, p in pending.items()} | {
            p.sentinel: s for s, p in pending.items()
        }
        for stage in {waited[item] for item in wait(list(waited), 0.2)}:
            try:
                msg = decoder.decode(pending[stage].conn.recv_bytes())
            except (EOFError, OSError):
                raise EngineStartError(f"{stage} exited during start-up") from None
            if isinstance(msg, StageFailed):
                raise EngineStartError(f"{stage} failed to start: {msg.message}")
            if isinstance(msg, StageReady):
                del pending[stage]

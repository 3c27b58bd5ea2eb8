"""Spawn and supervise the stages.

``launch(model=..., **config)`` creates a private runtime directory (mode 0700) for the
``ipc://`` sockets, the shm rings and the lockstep counter (owned, and unlinked, by this
process), spawns the stages with readable titles (``mpengine: scheduler`` ...), waits until
they can serve (model loaded, KV cache sized) and watches them: if one dies, the others are
stopped, segments and socket files are removed, and every client sees ``EngineDeadError``
(its sockets disconnect).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from pathlib import Path

import msgspec

from mpengine.config import EngineConfig, MiB
from mpengine.protocol import (
    ModelInfo,
    StageFailed,
    StageReady,
    Wiring,
    control_decoder,
    encoder,
)
from shm import Lockstep, Ring, sweep_stale
from shm.segment import pid_alive

logger = logging.getLogger(__name__)

STOP_GRACE_S = 5.0


class EngineStartError(RuntimeError):
    pass


class EngineDeadError(RuntimeError):
    """The engine stopped while requests were in flight."""


def sweep_stale_runtime_dirs() -> list[str]:
    """Remove runtime dirs (``mpengine-<engine id>-<launcher pid>-*``) of dead launchers."""
    removed = []
    root = Path(tempfile.gettempdir())
    for path in root.glob("mpengine-*-*-*"):
        parts = path.name.split("-")
        if len(parts) < 4 or not parts[2].isdigit() or pid_alive(int(parts[2])):
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(str(path))
    return removed


def _addresses(config: EngineConfig, runtime_dir: str) -> tuple[str, str]:
    if config.address and config.address.startswith("tcp://"):
        host, port = config.address.rsplit(":", 1)
        return f"{host}:{port}", f"{host}:{int(port) + 1}"
    base = config.address[len("ipc://") :] if config.address else runtime_dir
    os.makedirs(base, mode=0o700, exist_ok=True)
    return f"ipc://{base}/requests.sock", f"ipc://{base}/outputs.sock"


class StageProcess:
    """A stage as a child process: ``python -m mpengine.runtime.stage STAGE FD PPID``.

    A fresh interpreter (not multiprocessing's spawn) so the caller's ``__main__`` is never
    re-imported; the control connection is one end of a socketpair; ``sentinel`` is a pidfd
    that becomes readable when the process exits.
    """

    def __init__(self, stage: str) -> None:
        self.stage = stage
        ours, theirs = socket.socketpair()
        env = dict(os.environ)
        root = str(Path(__file__).resolve().parent.parent)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        argv = [sys.executable, "-m", "mpengine.runtime.stage", stage, str(theirs.fileno())]
        self.popen = subprocess.Popen(
            [*argv, str(os.getpid())],
            pass_fds=(theirs.fileno(),),
            stdin=subprocess.DEVNULL,
            env=env,
        )
        theirs.close()
        self.conn = Connection(ours.detach())
        self.pid = self.popen.pid
        self.sentinel = os.pidfd_open(self.pid)

    @property
    def exitcode(self) -> int | None:
        return self.popen.poll()

    def is_alive(self) -> bool:
        return self.popen.poll() is None

    def terminate(self) -> None:
        self.popen.terminate()

    def join(self, timeout: float | None = None) -> None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout)

    def close(self) -> None:
        self.conn.close()
        os.close(self.sentinel)


class Engine:
    """A running engine; a context manager that stops it on exit."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config = config.resolve()
        self.model: ModelInfo | None = None
        self.dead: str | None = None
        self._stopping = threading.Event()
        self._stop_lock = threading.Lock()
        self.stopped = threading.Event()  # set once the stages are gone and cleaned up
        self._death_callbacks: list[Callable[[str], None]] = []
        self._segments: list = []
        swept = sweep_stale() + sweep_stale_runtime_dirs()
        if swept:
            logger.info("removed %d stale shm objects and dirs of dead engines", len(swept))
        self.runtime_dir = tempfile.mkdtemp(prefix=f"mpengine-{config.engine_id}-{os.getpid()}-")
        request_address, output_address = _addresses(config, self.runtime_dir)
        self.wiring = Wiring(request_address, output_address)
        self.processes: dict[str, StageProcess] = {}
        try:
            if config.runtime == "processes":
                self.wiring = self._create_segments()
                stages = ("executor", "scheduler", "output")
            else:
                stages = ("engine",)
            self._spawn(stages)
            self._wait_ready(stages)
        except BaseException:
            self._stop_all()
            raise
        self._supervisor = threading.Thread(target=self._supervise, name="mpengine-supervisor")
        self._supervisor.daemon = True
        self._supervisor.start()
        atexit.register(self.shutdown)

    # -- start ----------------------------------------------------------------------------

    def _create_segments(self) -> Wiring:
        engine_id, size = self.config.engine_id, self.config.ring_bytes
        rings = {}
        for purpose in ("plan", "result", "feedback", "announce"):
            rings[purpose] = Ring.create(engine_id, purpose, MiB if purpose == "announce" else size)
            self._segments.append(rings[purpose])  # tracked at once: unlinked if a later fails
        done = Lockstep.create(engine_id, "done")
        self._segments.append(done)
        return msgspec.structs.replace(
            self.wiring,
            plan_ring=rings["plan"].name,
            result_ring=rings["result"].name,
            feedback_ring=rings["feedback"].name,
            announce_ring=rings["announce"].name,
            lockstep=done.name,
        )

    def _spawn(self, stages: tuple[str, ...]) -> None:
        config_bytes, wiring_bytes = self.config.encode(), encoder.encode(self.wiring)
        for stage in stages:
            proc = StageProcess(stage)
            self.processes[stage] = proc
            proc.conn.send_bytes(config_bytes)
            proc.conn.send_bytes(wiring_bytes)

    def _wait_ready(self, stages: tuple[str, ...]) -> None:
        deadline = time.monotonic() + self.config.startup_timeout
        decoder = control_decoder()
        pending = set(stages)
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise EngineStartError(f"stages not ready in time: {sorted(pending)}")
            conns = {self.processes[s].conn: s for s in pending}
            sentinels = {self.processes[s].sentinel: s for s in pending}
            for ready in wait([*conns, *sentinels], remaining):
                stage = conns.get(ready) or sentinels[ready]
                try:
                    msg = decoder.decode(self.processes[stage].conn.recv_bytes())
                except (EOFError, OSError):
                    code = self.processes[stage].exitcode
                    raise EngineStartError(f"{stage} exited during start-up ({code})") from None
                if isinstance(msg, StageFailed):
                    raise EngineStartError(f"{stage} failed to start: {msg.message}")
                assert isinstance(msg, StageReady)
                pending.discard(stage)
                if msg.model is not None:
                    self.model = msg.model
                    for other in ("scheduler", "output"):
                        if other in self.processes:
                            self.processes[other].conn.send_bytes(encoder.encode(msg.model))
                logger.info("%s ready (pid %d)", stage, msg.pid)

    # -- supervise ------------------------------------------------------------------------

    def _supervise(self) -> None:
        sentinels = {p.sentinel: name for name, p in self.processes.items()}
        ready = wait(list(sentinels))
        if self._stopping.is_set():
            return
        name = sentinels[ready[0]]
        code = self.processes[name].exitcode
        reason = f"the {name} stage died (exit code {code})"
        logger.error("%s: stopping the engine", reason)
        self.dead = reason
        for callback in list(self._death_callbacks):
            callback(reason)
        self._stop_all(grace=0.5)

    def on_death(self, callback: Callable[[str], None]) -> None:
        self._death_callbacks.append(callback)

    # -- public ---------------------------------------------------------------------------

    @property
    def address(self) -> str:
        """What ``mpengine.Client(address)`` connects to."""
        return self.wiring.request_address

    @property
    def pids(self) -> dict[str, int]:
        return {name: p.pid for name, p in self.processes.items() if p.pid is not None}

    def client(self, **kwargs):
        from mpengine.client import Client

        client = Client(self.address, **kwargs)
        self.on_death(client._engine_died)
        return client

    def async_client(self, **kwargs):
        from mpengine.client import AsyncClient

        client = AsyncClient(self.address, **kwargs)
        self.on_death(client._engine_died)
        return client

    def shutdown(self) -> None:
        if self._stopping.is_set() and not self.processes:
            return
        self._stop_all()
        atexit.unregister(self.shutdown)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def _stop_all(self, grace: float = STOP_GRACE_S) -> None:
        self._stopping.set()
        with self._stop_lock:
            self._stop_processes(grace)

    def _stop_processes(self, grace: float) -> None:
        procs = list(self.processes.values())
        for proc in procs:
            if proc.is_alive():
                proc.terminate()  # SIGTERM: the loops see their stop flag within POLL_S
        deadline = time.monotonic() + grace
        for proc in procs:
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                os.kill(proc.pid, signal.SIGKILL)
                proc.join(5.0)
        for proc in procs:
            proc.close()
        self.processes.clear()
        for segment in self._segments:
            segment.close()
        self._segments = []
        shutil.rmtree(self.runtime_dir, ignore_errors=True)
        self.stopped.set()


def launch(model: str = "tiny", **kwargs: object) -> Engine:
    """Start an engine: ``with mpengine.launch(model="tiny") as engine: ...``."""
    return Engine(EngineConfig.from_kwargs(model=model, **kwargs))

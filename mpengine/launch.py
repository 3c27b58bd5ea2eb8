"""Spawn and supervise the stages.

``launch(model=..., **config)`` creates a private runtime directory (mode 0700) for the
``ipc://`` sockets, the shm rings and the lockstep counter (owned, and unlinked, by this
process), spawns the stages with readable titles (``mpengine: scheduler`` ...), waits until
they can serve (model loaded, KV cache sized) and watches them: if one dies, the others are
stopped, segments and socket files are removed, and every client sees ``EngineDeadError``
(its sockets disconnect), unless it restarts the stage (``runtime/restarts.py``).

Safe on a shared host:

- stages start as ``python -c STAGE_ENTRY`` (``runtime/stage_process.py``), which drops
  the caller's cwd from ``sys.path`` before any import (a stray ``setproctitle.py`` there
  must not run in the engine);
- every stage is spawned from one long-lived thread (``_Spawner``): ``PR_SET_PDEATHSIG``
  fires when the spawning *thread* exits, so a launch from a short-lived thread would
  otherwise kill its stages;
- a configured ``ipc://DIR`` must be this user's private directory (created 0700 when
  missing), and one engine at a time serves it: the launcher holds ``DIR/engine.lock``
  (``flock``, dropped by the kernel however the launcher dies);
- the stale sweeps remove only this user's leftovers of dead launchers of this pid
  namespace, and never fail a launch.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import logging
import os
import resource
import shutil
import signal
import stat
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any

import msgspec

from mpengine.addresses import split_tcp
from mpengine.client.async_client import AsyncClient
from mpengine.client.sync_client import Client
from mpengine.config import EngineConfig, MiB, available_cpus
from mpengine.errors import EngineStartError
from mpengine.launcher import C, Launcher
from mpengine.models.resolve import check_model
from mpengine.protocol import (
    ModelInfo,
    StageFailed,
    StageReady,
    Wiring,
    control_decoder,
    encoder,
)
from mpengine.runtime.engine_file import (
    ENGINE_FILE,
    RUNTIME_DIR_GLOB,
    read_engine_file,
    write_engine_file,
)
from mpengine.runtime.ranks import dist_init, rank_stages
from mpengine.runtime.restarts import RESTARTABLE, RESTARTABLE_WITH_RANKS, Restarts, exit_cause
from mpengine.runtime.stage import (
    ABORT_SIGNAL,
    DRAIN_SIGNAL,
    EXECUTOR_SIGNAL,
    RESYNC_SIGNAL,
)
from mpengine.runtime.stage_process import StageProcess, _stage_env, halt
from shm import Lockstep, Ring, sweep_stale
from shm.broadcast import Broadcast
from shm.reaper import Leftovers, Reaper, remove_ipc_files
from shm.segment import free_space as shm_free_bytes
from shm.segment import owner_prefix, pid_alive, pid_namespace

logger = logging.getLogger(__name__)

STOP_GRACE_S = 5.0
STARTUP_STOP_GRACE_S = 0.5
LOCK_NAME = "engine.lock"
LOCK_WAIT_S = 0.5  # for a reaper's brief hold of a dead engine's lock
LOCK_POLL_S = 0.01
IPC_FILES = ["requests.sock", "outputs.sock", ENGINE_FILE]  # what an engine puts in its ipc dir
DRAIN_TIMEOUT_S = 30.0
ABORT_GRACE_S = 5.0  # after a drain's deadline: for the aborted requests' final outputs
FLUSH_S = 0.1  # for the output stage's last sends (its sockets close with linger 0)
RINGS = 4  # plan, result, feedback, announce: ring_bytes each in /dev/shm
MAX_SOCKET_PATH = 107  # bytes of a Unix socket's path (sun_path, less its NUL)
OPEN_FILES = 65536  # the open-files limit an engine raises its soft limit to (as vLLM)


def raise_open_files_limit() -> None:
    """Raise this process's soft limit on open files towards ``OPEN_FILES`` (within the
    hard limit; the stages inherit it). Each IPC client holds a few descriptors in the
    scheduler's and output stage's sockets: at a 256 limit, about 240 clients made ZMQ
    abort the scheduler, and the engine died for every client."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = OPEN_FILES if hard == resource.RLIM_INFINITY else min(OPEN_FILES, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError) as exc:
            logger.warning("cannot raise the open-files limit from %d: %s", soft, exc)


def sweep_stale_runtime_dirs() -> list[str]:
    """Remove runtime dirs (``mpengine-<engine id>-<launcher pid>-<pid ns>-*`` in the temp
    dir) that dead launchers of this user and this pid namespace left behind.

    Another user's dirs are not ours to judge, and a pid of another namespace means nothing
    here. A dir that cannot be inspected or removed is logged and left: this never raises.
    """
    removed = []
    for path in Path(tempfile.gettempdir()).glob(RUNTIME_DIR_GLOB):
        parts = path.name.split("-")
        if not parts[2].isdigit() or parts[3] != pid_namespace():
            continue
        try:
            st = path.lstat()
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
                continue
            if pid_alive(int(parts[2])):
                continue
            shutil.rmtree(path)
        except FileNotFoundError:
            continue  # removed meanwhile
        except OSError as exc:
            logger.warning("stale sweep: left %s: %s", path, exc)
            continue
        removed.append(str(path))
    return removed


def private_dir(path: str) -> str:
    """``path`` (its parent resolved) as a directory only this user can change; created
    with mode 0700 when missing, and so are missing parents.

    Raises EngineStartError when it is a symlink, not a directory, owned by another user,
    or group/world-writable, or when another user could rename it or a parent, as
    OpenSSH's StrictModes checks a path: every parent must be owned by this user or root
    and writable by no one else, unless it is sticky (as /tmp) and what it holds on the
    path is this user's or root's. Whoever can swap the directory can swap the engine's
    sockets and read every prompt.
    """
    path = os.path.normpath(path)
    parent = os.path.dirname(path)
    try:
        parent = os.path.realpath(parent) if parent else os.getcwd()
        _make_private_parents(parent)
        path = os.path.join(parent, os.path.basename(path))
        with contextlib.suppress(FileExistsError):
            os.mkdir(path, 0o700)
        st = os.lstat(path)
    except OSError as exc:
        raise EngineStartError(f"cannot create ipc directory {path}: {exc.strerror}") from None
    euid = os.geteuid()
    problem = _unsafe_parent(path)
    if stat.S_ISLNK(st.st_mode):
        problem = "it is a symlink"
    elif not stat.S_ISDIR(st.st_mode):
        problem = "it is not a directory"
    elif st.st_uid != euid:
        problem = f"it is owned by uid {st.st_uid}, not by this user (uid {euid})"
    elif st.st_mode & 0o022:
        problem = f"it is group- or world-writable (mode {stat.S_IMODE(st.st_mode):o})"
    if problem:
        raise EngineStartError(
            f"refusing ipc directory {path}: {problem}; another user could swap the "
            "engine's sockets. Use a directory of your own with mode 0700."
        )
    return path


def _make_private_parents(parent: str) -> None:
    """Create the missing directories of ``parent``, each with mode 0700."""
    missing = []
    while parent and not os.path.lexists(parent):
        missing.append(parent)
        parent = os.path.dirname(parent)
    for directory in reversed(missing):
        with contextlib.suppress(FileExistsError):
            os.mkdir(directory, 0o700)


def _unsafe_parent(path: str) -> str | None:
    """Why another user could rename ``path`` or one of its parents, or None."""
    euid = os.geteuid()
    child = path
    while (parent := os.path.dirname(child)) != child:
        st = os.lstat(parent)
        held = os.lstat(child).st_uid in (0, euid)
        if st.st_uid not in (0, euid):
            return f"its parent {parent} is owned by uid {st.st_uid}"
        if st.st_mode & 0o022 and not (st.st_mode & stat.S_ISVTX and held):
            mode = stat.S_IMODE(st.st_mode)
            return f"its parent {parent} is writable by others (mode {mode:o})"
        child = parent
    return None


def lock_dir(directory: str) -> int:
    """Take ``DIR/engine.lock`` (an exclusive ``flock``) and return its fd: one engine per
    ipc directory, so that a second one cannot rebind (and later delete) the first's sockets.

    The kernel drops the lock when the fd closes, however the launcher dies. The file is
    never removed: unlinking it would let two launchers lock two different files.
    """
    path = os.path.join(directory, LOCK_NAME)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    # A killed engine's reaper holds the lock for a moment while it removes the dead
    # engine's socket files: an engine restarted at once waits that out.
    deadline = time.monotonic() + LOCK_WAIT_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            if time.monotonic() >= deadline:
                os.close(fd)
                raise EngineStartError(
                    f"address ipc://{directory} is in use: another engine serves it (it holds "
                    f"{path})"
                ) from None
            time.sleep(LOCK_POLL_S)


def _check_model(config: EngineConfig) -> None:
    """A model or tokenizer that cannot work is refused before any stage starts (the
    executor would find out after seconds of start-up): ``models.resolve.check_model``."""
    try:
        check_model(config.model, config.tokenizer)
    except (ValueError, OSError) as exc:
        raise EngineStartError(str(exc)) from None


class Engine(Launcher):
    """A running engine; a context manager that stops it on exit. With
    ``data_parallel_size`` above 1, ``Engine(config)`` starts every replica
    (``data_parallel.DataParallelEngine``); the set starts each as an ``Engine`` of its own
    (``replica=True``)."""

    def __new__(cls, config: EngineConfig, *, replica: bool = False) -> Any:
        if config.data_parallel_size > 1 and not replica:
            from mpengine.data_parallel import DataParallelEngine

            return DataParallelEngine(config)
        return super().__new__(cls)

    def __init__(self, config: EngineConfig, *, replica: bool = False) -> None:
        self.config = config = config.resolve()
        # Which data-parallel replica (None: alone): its clients hear of deaths as its.
        self.replica = config.data_parallel_rank if config.data_parallel_size > 1 else None
        self._pid = os.getpid()  # a forked child's copy must not stop its parent's engine
        self.model: ModelInfo | None = None
        self.dead: str | None = None
        # Stages restarted after they died (``restarts.py``); the one restarting now.
        self.restarts = Restarts(
            config.max_stage_restarts,
            config.stage_restart_window_s,
            restartable=RESTARTABLE if config.tensor_parallel_size == 1 else RESTARTABLE_WITH_RANKS,
        )
        self.recovering: str | None = None
        self.generations = {"output": 0, "executor": 0}  # restarts so far, of each
        self._stopping = threading.Event()
        self._stop_lock = threading.Lock()
        self.stopped = threading.Event()  # set once the stages are gone and cleaned up
        self._death_callbacks: list[Callable[[str], None]] = []
        self._clients: weakref.WeakSet[Client | AsyncClient] = weakref.WeakSet()
        self._segments: list = []
        self._ipc_dir: str | None = None  # the directory of the ipc sockets ...
        self._lock_fd: int | None = None  # ... and its engine.lock, while this engine holds it
        if config.node_rank > 0:
            raise EngineStartError(
                f"node_rank {config.node_rank}: this host runs only its ranks, with "
                "'mpengine serve --headless'; the engine runs on node 0"
            )
        _check_model(config)
        raise_open_files_limit()
        if config.runtime == "processes" and available_cpus() < 2:
            logger.warning(
                "one CPU for three stage processes: runtime='serial' runs faster here (the "
                "stages cannot overlap, and they wake each other up)"
            )
        try:
            swept = sweep_stale() + sweep_stale_runtime_dirs()
        except OSError as exc:  # (no usable temporary directory, above all)
            raise EngineStartError(
                f"cannot use the temporary directory for the engine's runtime files ({exc}): "
                "set TMPDIR to a writable directory"
            ) from None
        if swept:
            logger.info("removed %d stale shm objects and dirs of dead engines", len(swept))
        if config.address and config.address.startswith("tcp://") and not config.auth_token:
            logger.warning(
                "%s takes clients without an auth token: every user of this host (and every "
                "host that reaches the port) can use the engine; give it --auth-token-file",
                config.address,
            )
        try:
            self.runtime_dir = tempfile.mkdtemp(
                prefix=f"mpengine-{config.engine_id}-{os.getpid()}-{pid_namespace()}-"
            )
        except OSError as exc:
            raise EngineStartError(
                f"cannot create the engine's runtime directory ({exc}): set TMPDIR to a "
                "writable directory"
            ) from None
        self.processes: dict[str, StageProcess] = {}
        self._reaper: Reaper | None = None
        try:
            self.wiring = self._addresses()
            self._reaper = self._start_reaper()
            if config.runtime == "processes":
                self.wiring = self._create_segments()
                stages = self._stages()
            else:
                stages = ("engine",)
            self._spawn(stages)
            self._wait_ready(stages)
            self._write_engine_file(keep=False)
        except BaseException:  # (Ctrl-C too: stages loading a model do not look at their
            # stop flag, and have nothing to save; they waited out the whole grace period)
            self._stop_all(grace=STARTUP_STOP_GRACE_S)
            raise
        self._supervisor = threading.Thread(target=self._supervise, name="mpengine-supervisor")
        self._supervisor.daemon = True
        self._supervisor.start()
        atexit.register(self.shutdown)

    # -- start ----------------------------------------------------------------------------

    def _addresses(self) -> Wiring:
        """tcp: requests on PORT, outputs on PORT+1 (a port in use fails the stage binding
        it). ipc: the sockets in a private directory that this engine alone serves."""
        address = self.config.address
        if (tcp := split_tcp(address or "")) is not None:  # checked by EngineConfig
            host, port = tcp
            return Wiring(f"tcp://{host}:{port}", f"tcp://{host}:{int(port) + 1}")
        base = private_dir(address[len("ipc://") :]) if address else self.runtime_dir
        longest = os.path.join(base, max(IPC_FILES, key=len))
        if len(os.fsencode(longest)) > MAX_SOCKET_PATH:
            raise EngineStartError(
                f"the ipc socket path {longest} is longer than the {MAX_SOCKET_PATH} bytes "
                "a Unix socket takes: "
                + ("give a shorter ipc address" if address else "set a shorter TMPDIR")
                + (" (or --address ipc://A_SHORT_DIR)" if not address else "")
            )
        self._lock_fd = lock_dir(base)
        self._ipc_dir = base
        return Wiring(f"ipc://{base}/requests.sock", f"ipc://{base}/outputs.sock")

    def _start_reaper(self) -> Reaper | None:
        """A small process that removes this engine's segments, runtime directory and ipc
        socket files if this process dies without stopping it (``shm/reaper.py``)."""
        leftovers = Leftovers(
            owner_pid=os.getpid(),
            shm_prefix=owner_prefix(self.config.engine_id),
            title="mpengine: reaper",
            trees=[self.runtime_dir],
            locked_dir=self._ipc_dir if self._ipc_dir != self.runtime_dir else None,
            lock_name=LOCK_NAME,
            files=IPC_FILES,
        )
        try:
            return Reaper.start(leftovers, env=_stage_env())
        except OSError as exc:
            logger.warning(
                "no reaper (leftovers of a killed launcher wait for the next launch): %s", exc
            )
            return None

    def _stages(self) -> tuple[str, ...]:
        """The processes runtime's stages: the executor's ranks first (they load the model)."""
        return ("executor", *rank_stages(self.config), "scheduler", "output")

    def _create_segments(self) -> Wiring:
        engine_id, size = self.config.engine_id, self.config.ring_bytes
        rings = {}
        num_rings = RINGS + (self.config.ranks_per_node > 1)
        need, free = num_rings * size, shm_free_bytes()
        if need > free:
            raise EngineStartError(
                f"the engine's {num_rings} shared-memory rings need {need / MiB:.0f} MiB "
                f"(ring_bytes {size / MiB:.1f} MiB each) in /dev/shm, which has "
                f"{free / MiB:.0f} MiB free: enlarge /dev/shm (docker run --shm-size=1g) or "
                "lower --ring-bytes (and --max-request-bytes below it)"
            )
        try:
            for purpose in ("plan", "result", "feedback", "announce"):
                rings[purpose] = Ring.create(engine_id, purpose, size)
                self._segments.append(rings[purpose])  # tracked at once: unlinked if a later fails
            done = Lockstep.create(engine_id, "done")
            self._segments.append(done)
            ranks = self._create_rank_ring()
        except FileExistsError as exc:
            raise EngineStartError(
                f"engine_id {engine_id!r} is in use by another engine ({exc}): give each "
                "engine its own id, or none"
            ) from None
        except OSError as exc:  # (/dev/shm filled meanwhile, or no room for a semaphore)
            raise EngineStartError(f"cannot create the engine's shared memory: {exc}") from None
        return msgspec.structs.replace(
            self.wiring,
            plan_ring=rings["plan"].name,
            result_ring=rings["result"].name,
            feedback_ring=rings["feedback"].name,
            announce_ring=rings["announce"].name,
            lockstep=done.name,
            rank_ring=ranks.name if ranks is not None else "",
            dist_init=dist_init(self.config) if self.config.tensor_parallel_size > 1 else "",
        )

    def _create_rank_ring(self) -> Broadcast | None:
        """The ring rank 0 broadcasts each plan on to this host's other ranks."""
        config = self.config
        if config.ranks_per_node == 1:
            return None
        ring = Broadcast.create(
            config.engine_id, "ranks", config.ring_bytes, config.ranks_per_node - 1
        )
        self._segments.append(ring)
        return ring

    def _spawn(self, stages: tuple[str, ...]) -> None:
        config_bytes, wiring_bytes = self.config.encode(), encoder.encode(self.wiring)
        for stage in stages:
            proc = StageProcess(stage, self.runtime_dir)
            self.processes[stage] = proc
            proc.conn.send_bytes(config_bytes)
            proc.conn.send_bytes(wiring_bytes)

    def _wait_ready(self, stages: tuple[str, ...], relay: bool = True) -> None:
        deadline = time.monotonic() + self.config.startup_timeout
        decoder = control_decoder()
        pending = set(stages)
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise EngineStartError(
                    f"stages not ready within startup_timeout ({self.config.startup_timeout:g} "
                    f"s, --startup-timeout): {sorted(pending)}"
                )
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
                if msg.model is not None and not relay:  # a restarted executor
                    if msg.model.num_blocks != self.model.num_blocks:  # type: ignore[union-attr]
                        raise EngineStartError(
                            f"the restarted executor has {msg.model.num_blocks} KV blocks, "
                            f"not {self.model.num_blocks}"  # type: ignore[union-attr]
                        )
                elif msg.model is not None:
                    self.model = msg.model
                    for other in ("scheduler", "output"):
                        if other in self.processes:
                            self.processes[other].conn.send_bytes(encoder.encode(msg.model))
                logger.info("%s ready (pid %d)", stage, msg.pid)

    # -- supervise ------------------------------------------------------------------------

    def _supervise(self) -> None:
        while True:
            sentinels = {p.sentinel: name for name, p in self.processes.items()}
            ready = wait(list(sentinels))
            if self._stopping.is_set():
                return
            name = sentinels[ready[0]]
            reason = f"the {name} stage died ({exit_cause(self.processes[name].exitcode)})"
            if (message := self._failure_of(name)) is not None:
                reason += f": {message}"
            if not self._restart(name, reason):
                break
        if self._stopping.is_set():
            return
        self.dead = reason
        logger.error("%s: stopping the engine", reason)
        self._end_clients(reason)
        for callback in list(self._death_callbacks):
            callback(reason)
        self._stop_all(grace=0.5)
        atexit.unregister(self.shutdown)  # stopped: nothing left for the exit hook to do

    def _restart(self, stage: str, reason: str) -> bool:
        """Start ``stage`` again in place of the one that died (``restarts.py``), as long
        as the limit allows (a start that fails is one more); whether it runs again."""
        while self.restarts.allow(stage) and not self._stopping.is_set():
            count = self.restarts.record(stage)
            self.recovering = stage
            self._tell_clients(stage)
            logger.error("%s: restarting it (restart %d)", reason, count)
            try:
                self._respawn(stage, reason)
            except (EngineStartError, OSError) as exc:
                reason = f"{reason}; its restart failed ({exc})"
                continue
            finally:
                self.recovering = None
                self._tell_clients(None)
            logger.info("%s stage restarted (pid %d)", stage, self.processes[stage].pid)
            return True
        if stage in RESTARTABLE and not self._stopping.is_set():
            limit, window = self.config.max_stage_restarts, self.config.stage_restart_window_s
            logger.error("%s: no more restarts (at most %d in %g s)", stage, limit, window)
        return False

    def _respawn(self, stage: str, reason: str) -> None:
        """``stage`` again (it died: ``reason``), of its next generation. The scheduler: the
        engine again but for the launcher (``_restart_all``). An output processor: the scheduler
        re-announces every request for it (``RESYNC_SIGNAL``), its clients connect to it by
        themselves. An executor (with the KV cache's geometry of its predecessor): once the
        output processor has taken the dead one's last result, the scheduler recomputes
        what it had computed (``EXECUTOR_SIGNAL``)."""
        if stage == "scheduler":
            for client in list(self._clients):
                client.scheduler_lost(reason, self.replica)
            self._restart_all()
            return
        old = self.processes[stage]
        old.join(0)
        old.close()
        config = self.config
        assert self.model is not None
        if stage == "output":
            self.generations["output"] += 1
            self._signal_scheduler(RESYNC_SIGNAL)
        else:
            self._wait_results_taken()
            self.generations["executor"] += 1
            self._signal_scheduler(EXECUTOR_SIGNAL)
            config = msgspec.structs.replace(config, num_gpu_blocks_override=self.model.num_blocks)
        wiring = msgspec.structs.replace(
            self.wiring,
            output_generation=self.generations["output"],
            executor_generation=self.generations["executor"],
            clients_returning=True,
        )
        with self._stop_lock:
            if self._stopping.is_set():
                raise EngineStartError("the engine is stopping")
            proc = self.processes[stage] = StageProcess(stage, self.runtime_dir)
        proc.conn.send_bytes(config.encode())
        proc.conn.send_bytes(encoder.encode(wiring))
        if stage == "output":
            proc.conn.send_bytes(encoder.encode(self.model))
        self._wait_ready((stage,), relay=False)
        self._write_engine_file()

    def _restart_all(self) -> None:
        """The engine again but for the launcher, after its scheduler died with every
        request: the other stages stopped, new segments, the three started (the model
        loaded again). Clients keep their connections (their requests in flight fail)."""
        with self._stop_lock:
            if self._stopping.is_set():
                raise EngineStartError("the engine is stopping")
            halt(list(self.processes.values()), STOP_GRACE_S)
            self.processes.clear()
            for segment in self._segments:
                segment.close()
            self._segments = []
            self.wiring = msgspec.structs.replace(self._create_segments(), clients_returning=True)
            self.generations = {"output": 0, "executor": 0}
            stages = self._stages()
            self._spawn(stages)
        self._wait_ready(stages)
        self._write_engine_file()

    def _write_engine_file(self, keep: bool = True) -> None:
        """How ``mpengine stacks/top ADDRESS`` find the stages; ``keep``: what else the
        file says (``mpengine serve``'s URL) after a restart."""
        if self._ipc_dir is None:
            return
        record = (read_engine_file(self._ipc_dir) if keep else None) or {}
        record |= dict(pid=os.getpid(), runtime_dir=self.runtime_dir, stages=self.pids)
        write_engine_file(self._ipc_dir, record)

    def _wait_results_taken(self) -> None:
        """Wait until the output processor has taken every result in the ring (after
        their feedback: the scheduler then knows all that a dead executor computed)."""
        ring = next(s for s in self._segments if getattr(s, "name", "") == self.wiring.result_ring)
        deadline = time.monotonic() + self.config.startup_timeout
        while ring.used_bytes:
            output = self.processes["output"]
            if not output.is_alive() or time.monotonic() > deadline:
                raise EngineStartError("the output processor did not take the last results")
            time.sleep(0.001)

    def _failure_of(self, stage: str) -> str | None:
        """What a stage that raised reported before it left (None when it was killed)."""
        conn, decoder = self.processes[stage].conn, control_decoder()
        with contextlib.suppress(EOFError, OSError, msgspec.DecodeError):
            while conn.poll(0):
                msg = decoder.decode(conn.recv_bytes())
                if isinstance(msg, StageFailed):
                    return msg.message
        return None

    def _tell_clients(self, recovering: str | None) -> None:
        """Tell this engine's clients which stage restarts now (None: none): a client of
        several replicas sends new requests to the others meanwhile."""
        for client in list(self._clients):
            client.replica_recovering(recovering, self.replica)

    def _end_clients(self, reason: str) -> None:
        """Fail what this engine's clients wait for, with ``reason``, before they see its
        sockets close (which says only that it stopped or died)."""
        for client in list(self._clients):
            client.engine_died(reason, self.replica)

    def on_death(self, callback: Callable[[str], None]) -> None:
        """Call ``callback(reason)`` (from the supervisor thread) if a stage dies."""
        self._death_callbacks.append(callback)

    # -- public ---------------------------------------------------------------------------

    @property
    def address(self) -> str:
        """What ``mpengine.Client(address)`` connects to."""
        return self.wiring.request_address

    @property
    def pids(self) -> dict[str, int]:
        """Each stage's process id, by stage name."""
        return {name: p.pid for name, p in self.processes.items() if p.pid is not None}

    def _make_client(
        self, kind: type[C], timeout: float, client_id: str | None, token: str | None
    ) -> C:
        client = kind(self.address, timeout=timeout, client_id=client_id, auth_token=token)
        self.supervise(client)
        return client

    def supervise(self, client: Client | AsyncClient) -> None:
        """Tell ``client`` (of this process) at once when a stage dies (held weakly)."""
        client.mark_supervised()
        self._clients.add(client)

    def shutdown(self, drain: bool = False, drain_timeout: float = DRAIN_TIMEOUT_S) -> None:
        """Stop the engine; with ``drain``, first let admitted requests finish for up to
        ``drain_timeout`` seconds (see ``drain``)."""
        if os.getpid() != self._pid:  # a forked child exiting: the engine is its parent's
            return
        atexit.unregister(self.shutdown)  # (also after a stage died: the hook kept it alive)
        if self._stopping.is_set() and not self.processes:
            return
        if drain and self.dead is None and self.processes:
            self.drain(drain_timeout)
        self._end_clients("the engine was shut down")
        self._stop_all()

    # -- drain ----------------------------------------------------------------------------

    def stop_admitting(self) -> None:
        """From now on the scheduler refuses new requests (``InvalidRequestError`` of kind
        ``overloaded``, saying the engine is draining); admitted ones go on."""
        self._signal_scheduler(DRAIN_SIGNAL)

    def abort_unfinished(self) -> None:
        """Abort every unfinished request: each client gets final outputs with reason
        ``abort``."""
        self._signal_scheduler(ABORT_SIGNAL)

    def drain(self, timeout: float = DRAIN_TIMEOUT_S) -> bool:
        """Stop admitting, wait up to ``timeout`` seconds for the admitted requests to
        finish, then abort the rest. Whether all finished in time. The engine still runs
        (stats, the clients' connections) but refuses new requests from then on: a drain
        precedes a shutdown."""
        self.stop_admitting()
        with self.client() as client:
            finished = wait_until_idle(client, timeout)
            if not finished:
                self.abort_unfinished()
                wait_until_idle(client, ABORT_GRACE_S)
        time.sleep(FLUSH_S)
        return finished

    def _signal_scheduler(self, signum: int) -> None:
        stage = self.processes.get("scheduler") or self.processes.get("engine")
        if stage is not None and stage.is_alive():
            os.kill(stage.pid, signum)

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

        def kill_now() -> None:
            for proc in procs:
                with contextlib.suppress(ValueError, ProcessLookupError):
                    if proc.is_alive():
                        os.kill(proc.pid, signal.SIGKILL)

        with _interrupts_hurry(kill_now):
            self._reap(procs, grace)

    def _reap(self, procs: list[StageProcess], grace: float) -> None:
        halt(procs, grace)
        self.processes.clear()
        if procs and self.config.trace:
            # Each stage wrote its part of the trace as it stopped: one file to open.
            from mpengine.runtime.timing import merge_trace

            merge_trace(self.config.trace, [proc.stage for proc in procs])
        for segment in self._segments:
            segment.close()
        self._segments = []
        shutil.rmtree(self.runtime_dir, ignore_errors=True)
        if self._lock_fd is not None and self._ipc_dir is not None:
            # The stages are gone and the directory is still ours: remove the socket files
            # a killed stage left, then let the next engine have it.
            remove_ipc_files(self._ipc_dir, IPC_FILES)
            os.close(self._lock_fd)
            self._lock_fd = None
        if self._reaper is not None:
            self._reaper.release()
            self._reaper = None
        self.stopped.set()


@contextlib.contextmanager
def _interrupts_hurry(hurry: Callable[[], None]) -> Iterator[None]:
    """While the engine stops: a Ctrl-C (SIGINT) calls ``hurry`` instead of interrupting
    the clean-up half-way (which left the runtime dir and unreaped stages behind); the
    ``KeyboardInterrupt`` is raised once it is done. Only the main thread can do this."""
    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGINT) is signal.SIG_IGN  # ignored on purpose: still
    ):
        yield
        return
    interrupted: list[int] = []

    def handler(signum: int, _frame: object) -> None:
        interrupted.append(signum)
        hurry()

    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous if previous is not None else signal.SIG_DFL)
    if interrupted:
        raise KeyboardInterrupt


def launch(model: str = "tiny", **kwargs: object) -> Engine:
    """Start an engine: ``with mpengine.launch(model="tiny") as engine: ...``."""
    return Engine(EngineConfig.from_kwargs(model=model, **kwargs))


def wait_until_idle(client, timeout: float, poll_s: float = 0.05) -> bool:
    """Poll the scheduler's stats until no request is left and no step is in flight;
    whether that happened within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            stats = client.stats(timeout=max(0.1, deadline - time.monotonic()))
        except TimeoutError:
            return False
        busy = stats.num_running + stats.num_waiting + stats.num_preempted
        if busy == 0 and stats.done == stats.step:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(poll_s)

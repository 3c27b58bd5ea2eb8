"""Data-parallel replicas: ``data_parallel_size`` whole engines (each its own three stages,
rings, KV cache and devices; with ``tensor_parallel_size``, its own ranks and process
group) behind one front, as vLLM's ``--data-parallel-size``.

``DataParallelEngine`` starts them (``Engine(config)`` and ``launch`` do, for a config of
more than one) and answers as one engine: its ``address`` is the replicas' addresses,
separated by commas, which a ``Client`` takes as one engine of several replicas and routes
requests between (``client/replicas.py``, ``client/routing.py``). Where they run:

- ``mp`` (the default): an ``Engine`` each, in this process, at ``ipc://DIR/dpN`` (or the
  given ``tcp://HOST:PORT`` plus ``2 N``); a GPU each (``CUDA_VISIBLE_DEVICES``) when the
  host has enough, else shares of one (``gpu_memory_utilization`` split); on the CPU the
  cores split (``EngineConfig.max_threads``).
- ``ray``: a Ray actor each, on whichever node has its resources (``runtime/ray_replicas.py``);
  steps still go over shm and ZMQ on that node, never through Ray.

A replica that dies (a stage that its engine could not bring back, a tensor-parallel rank)
fails its own requests and leaves the clients' rotation at once; the others serve, and it
is started again (at most ``max_stage_restarts`` times in ``stage_restart_window_s``), when
the clients take it back. The set is dead when every replica is.

``RemoteReplicas`` is the same front for engines started elsewhere (``mpengine serve
--engine-address``): nothing to start, only addresses.
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import tempfile
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgspec

from mpengine.addresses import split_tcp
from mpengine.client.async_client import AsyncClient
from mpengine.client.sync_client import Client
from mpengine.config import EngineConfig, available_cpus
from mpengine.errors import EngineStartError
from mpengine.launch import DRAIN_TIMEOUT_S, Engine, wait_until_idle
from mpengine.launcher import C, Launcher
from mpengine.runtime.restarts import Restarts

logger = logging.getLogger(__name__)

REPLICA_STOP_S = 10.0  # for a dead replica's engine to clean up before it starts again


def gpu_count() -> int:
    """The GPUs this host gives its processes, without importing torch: those of
    ``CUDA_VISIBLE_DEVICES`` when set, else those the NVIDIA driver lists."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"])
    try:
        return len(os.listdir("/proc/driver/nvidia/gpus"))
    except OSError:
        return 0


def replica_address(address: str | None, index: int, base: str) -> str:
    """Replica ``index``'s address: ``tcp://HOST:PORT`` plus two ports per replica (its
    requests and outputs), ``ipc://DIR/dpN``, or under ``base`` when none is given."""
    if (tcp := split_tcp(address or "")) is not None:
        host, port = tcp
        return f"tcp://{host}:{int(port) + 2 * index}"
    directory = address[len("ipc://") :] if address else base
    return f"ipc://{os.path.join(directory, f'dp{index}')}"


def replica_config(config: EngineConfig, index: int, base: str, gpus: int) -> EngineConfig:
    """The config of replica ``index``: its address, its name, its devices."""
    suffix = f"_dp{index}"
    updates: dict[str, Any] = {
        "data_parallel_rank": index,
        "engine_id": config.engine_id[: 16 - len(suffix)] + suffix,
        "address": replica_address(config.address, index, base),
    }
    if config.tensor_parallel_size > 1 and config.master_port:  # each its process group
        updates["master_port"] = config.master_port + 2 * index
    if config.device != "cpu" and gpus:
        size, tp = config.data_parallel_size, config.tensor_parallel_size
        if gpus >= size * tp and config.cuda_visible_devices is None:
            updates["cuda_visible_devices"] = ",".join(
                str(d) for d in range(index * tp, (index + 1) * tp)
            )
        else:  # replicas share the GPUs: each its share of the memory
            updates["gpu_memory_utilization"] = config.gpu_memory_utilization / size
    return msgspec.structs.replace(config, **updates)


class DataParallelEngine(Launcher):
    """The replicas of one engine, started and supervised here (see the module's
    docstring); the launcher's surface of an ``Engine``."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config = config.resolve()
        size = config.data_parallel_size
        self._pid = os.getpid()
        self.dead: str | None = None
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._death_callbacks: list[Callable[[str], None]] = []
        self._clients: weakref.WeakSet[Client | AsyncClient] = weakref.WeakSet()
        self.restarts = Restarts(
            config.max_stage_restarts,
            config.stage_restart_window_s,
            restartable=frozenset(f"replica {i}" for i in range(size)),
        )
        self.restarting: set[int] = set()
        self.runtime_dir = tempfile.mkdtemp(prefix=f"mpengine-{config.engine_id}-dp-")
        gpus = gpu_count() if config.distributed_executor_backend == "mp" else 0
        self.configs = [replica_config(config, i, self.runtime_dir, gpus) for i in range(size)]
        self.replicas: list[Any] = [None] * size
        if config.distributed_executor_backend == "ray":
            from mpengine.runtime.ray_replicas import connect_ray

            connect_ray(None)
        try:
            with ThreadPoolExecutor(size) as pool:  # (in parallel: the model loads overlap)
                list(pool.map(self._start, range(size)))
        except BaseException:
            self._stop_all()
            raise
        atexit.register(self.shutdown)

    def _start(self, index: int) -> None:
        """Start replica ``index`` (blocks until it serves)."""
        config = self.configs[index]
        if config.distributed_executor_backend == "ray":
            from mpengine.runtime.ray_replicas import RayReplica

            replica: Any = RayReplica(config, index, num_cpus=self._cpu_share())
        else:
            replica = Engine(config, replica=True)
        with self._lock:
            if self._stopping.is_set():
                replica.shutdown()
                raise EngineStartError("the engine is stopping")
            self.replicas[index] = replica
            for client in list(self._clients):
                if hasattr(replica, "supervise"):
                    replica.supervise(client)
                client.replica_moved(index, replica.address)  # (Ray: another node, port)
        replica.on_death(lambda reason: self._replica_died(index, reason))
        logger.info("replica %d serves at %s", index, replica.address)

    def _cpu_share(self) -> float:
        """The CPUs a Ray actor of one replica asks for: its share of this host's."""
        return max(1.0, available_cpus() / self.config.data_parallel_size)

    # -- supervise ------------------------------------------------------------------------

    def _replica_died(self, index: int, reason: str) -> None:
        """A replica's engine died (its supervisor's thread): its clients' requests on it
        fail, and it is started again while the limit allows."""
        reason = f"replica {index}: {reason}"
        for client in list(self._clients):
            client.engine_died(reason, index)
        if self._stopping.is_set():
            return
        logger.error("%s; the other replicas serve", reason)
        threading.Thread(
            target=self._restart, args=(index, reason), name=f"mpengine-replica-{index}"
        ).start()

    def _restart(self, index: int, reason: str) -> None:
        old = self.replicas[index]
        stopped = getattr(old, "stopped", None)
        if stopped is not None:
            stopped.wait(REPLICA_STOP_S)
        name = f"replica {index}"
        while self.restarts.allow(name) and not self._stopping.is_set():
            count = self.restarts.record(name)
            self.restarting.add(index)
            logger.error("%s: starting it again (restart %d)", reason, count)
            try:
                self._start(index)
                return
            except (EngineStartError, OSError) as exc:
                reason = f"{reason}; its restart failed ({exc})"
            finally:
                self.restarting.discard(index)
        if self._stopping.is_set():
            return
        logger.error("%s: no more restarts", reason)
        if all(self._gone(i) for i in range(len(self.replicas))):
            self.dead = f"every replica died (the last, {reason})"
            for callback in list(self._death_callbacks):
                callback(self.dead)

    def _gone(self, index: int) -> bool:
        replica = self.replicas[index]
        return index not in self.restarting and (replica is None or replica.dead is not None)

    def on_death(self, callback: Callable[[str], None]) -> None:
        """Call ``callback(reason)`` (from a supervisor thread) once every replica died."""
        self._death_callbacks.append(callback)

    # -- public ---------------------------------------------------------------------------

    @property
    def addresses(self) -> list[str]:
        """Each replica's address (a Ray replica's is its node's, known once placed)."""
        return [
            config.address if replica is None else replica.address  # type: ignore[misc]
            for config, replica in zip(self.configs, self.replicas, strict=True)
        ]

    @property
    def address(self) -> str:
        """What ``mpengine.Client(address)`` connects to: every replica's address."""
        return ",".join(self.addresses)

    @property
    def model(self) -> Any:
        return next((r.model for r in self.replicas if r is not None), None)

    @property
    def recovering(self) -> str | None:
        """What is being restarted now, if anything (a replica, or a replica's stage)."""
        if self.restarting:
            return f"replica {min(self.restarting)}"
        for index, replica in enumerate(self.replicas):
            if replica is not None and replica.recovering:
                return f"{replica.recovering} stage of replica {index}"
        return None

    @property
    def pids(self) -> dict[str, int]:
        """Each replica's stages' process ids, as ``STAGE dpN``."""
        return {
            f"{stage} dp{index}": pid
            for index, replica in enumerate(self.replicas)
            if replica is not None
            for stage, pid in replica.pids.items()
        }

    def _make_client(
        self, kind: type[C], timeout: float, client_id: str | None, token: str | None
    ) -> C:
        """A client of every replica (routing as ``data_parallel_routing`` says)."""
        client = kind(
            self.addresses,
            timeout=timeout,
            client_id=client_id,
            auth_token=token,
            routing=self.config.data_parallel_routing,
        )
        client.mark_supervised()
        with self._lock:
            self._clients.add(client)
            for replica in self.replicas:
                if hasattr(replica, "supervise"):
                    replica.supervise(client)
        return client

    def stop_admitting(self) -> None:
        self._each(lambda replica: replica.stop_admitting())

    def abort_unfinished(self) -> None:
        self._each(lambda replica: replica.abort_unfinished())

    def drain(self, timeout: float = DRAIN_TIMEOUT_S) -> bool:
        """As ``Engine.drain``, every replica at once."""
        self.stop_admitting()
        with self.client() as client:
            finished = wait_until_idle(client, timeout)
            if not finished:
                self.abort_unfinished()
                wait_until_idle(client, 5.0)
        return finished

    def shutdown(self, drain: bool = False, drain_timeout: float = DRAIN_TIMEOUT_S) -> None:
        if os.getpid() != self._pid:
            return
        atexit.unregister(self.shutdown)
        if drain and not self._stopping.is_set() and self.dead is None:
            self.drain(drain_timeout)
        for client in list(self._clients):
            client.engine_died("the engine was shut down")
        self._stop_all()

    def _stop_all(self) -> None:
        self._stopping.set()
        with self._lock:
            replicas = [r for r in self.replicas if r is not None]
        if replicas:
            with ThreadPoolExecutor(len(replicas)) as pool:
                list(pool.map(lambda replica: replica.shutdown(), replicas))
        shutil.rmtree(self.runtime_dir, ignore_errors=True)

    def _each(self, act: Callable[[Any], object]) -> None:
        for replica in self.replicas:
            if replica is not None and replica.dead is None:
                act(replica)

    def __enter__(self) -> DataParallelEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


class RemoteReplicas(Launcher):
    """The front's view of engines started elsewhere (``mpengine serve --engine-address``,
    repeated): their addresses and the token they take; nothing to start or stop (a
    replica out of reach is the clients' to retry)."""

    def __init__(self, config: EngineConfig, addresses: list[str]) -> None:
        self.config = config
        self.addresses = addresses
        self.dead: str | None = None
        self._stopping = threading.Event()
        self.recovering: str | None = None
        self.model = None
        self.pids: dict[str, int] = {}
        self.restarts = Restarts(0, 1.0)
        self.runtime_dir = tempfile.mkdtemp(prefix="mpengine-front-")

    @property
    def address(self) -> str:
        return ",".join(self.addresses)

    def _make_client(
        self, kind: type[C], timeout: float, client_id: str | None, token: str | None
    ) -> C:
        routing = self.config.data_parallel_routing
        return kind(
            self.addresses, timeout=timeout, client_id=client_id, auth_token=token, routing=routing
        )

    def on_death(self, callback: Callable[[str], None]) -> None:
        """Never called: engines elsewhere are retried while they are out of reach."""

    def stop_admitting(self) -> None:
        """The engines are not this front's: it refuses new HTTP requests itself."""

    def abort_unfinished(self) -> None:
        """The front's own requests are aborted when its client closes."""

    def shutdown(self, drain: bool = False, drain_timeout: float = DRAIN_TIMEOUT_S) -> None:
        shutil.rmtree(self.runtime_dir, ignore_errors=True)

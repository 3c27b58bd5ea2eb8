"""Data-parallel replicas placed by Ray (``--distributed-executor-backend ray``).

Ray places and watches; it carries no step. A replica is a placement group of one bundle
(its share of CPUs, its tensor-parallel ranks' GPUs), reserved on whichever node has them,
and one actor in it that runs the replica's launcher (``launch.Engine``) at a tcp address
of that node. The engine's stages are the actor's child processes and step over shm and
ZMQ within the node, as on any host; the front connects to the address with the client
library. What crosses Ray: the config and the ``ModelInfo`` (msgspec bytes) at start,
drain, abort and shutdown, and a status poll every ``POLL_S`` that finds a dead engine or
actor. A replica that died is stopped as an ``Engine`` stops itself: its actor ended, its
bundle freed for the replica started in its place.

Ray's workers import mpengine as the caller does: every node has it installed (a checkout
installed editable, here), so no ``runtime_env`` is shipped.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Callable
from types import ModuleType
from typing import Any

import msgspec

from mpengine.addresses import MAX_PORT
from mpengine.config import EngineConfig
from mpengine.errors import EngineStartError
from mpengine.launch import DRAIN_TIMEOUT_S, Engine
from mpengine.protocol import ModelInfo, encoder
from mpengine.runtime.restarts import Restarts

# How often the front asks each actor about its engine: a death is told within about
# POLL_S, for some 0.7 ms of CPU a poll (the front's and the actor's, on two cores).
POLL_S = 0.5
CALL_TIMEOUT_S = 10.0  # for an actor's answer to a status poll or a control call
START_SLACK_S = 60.0  # the actor's own start (a worker, its imports) beside the engine's
STOP_S = 30.0  # an engine's shutdown past its drain: its stages' grace, an abort's
# A status poll is answered while a drain or shutdown runs in the actor.
ACTOR_CONCURRENCY = 4
NO_RAY = "--distributed-executor-backend ray needs Ray: pip install 'mpengine[ray]'"


def _ray() -> ModuleType:
    """Ray, imported when a replica is placed: no other backend needs it installed."""
    try:
        import ray
    except ImportError:
        raise EngineStartError(NO_RAY) from None
    return ray


def connect_ray(address: str | None) -> None:
    """Join the Ray cluster at ``address`` unless this process has joined one. None is
    Ray's default: ``RAY_ADDRESS``, else the cluster ``ray start`` began on this host, else
    a new local one (2 to 4 s to start on two cores; no dashboard, and the workers' logs
    stay in Ray's files)."""
    ray = _ray()
    if not ray.is_initialized():
        # (ignore_reinit_error: threads of one process may race to here)
        ray.init(
            address=address,
            ignore_reinit_error=True,
            include_dashboard=False,
            log_to_driver=False,
        )


def gpus_per_replica(config: EngineConfig, cluster_gpus: float) -> int:
    """A replica's GPUs: one per tensor-parallel rank on CUDA (``auto``: when the cluster
    has GPUs), none on the CPU."""
    cuda = config.device == "cuda" or (config.device == "auto" and cluster_gpus > 0)
    return config.tensor_parallel_size if cuda else 0


def _resources(resources: dict[str, float]) -> str:
    """The CPUs and GPUs of a Ray resource dict, for a person."""
    kinds = [f"{resources[k]:g} {k}" for k in ("CPU", "GPU") if resources.get(k)]
    return ", ".join(kinds) or "no CPU or GPU"


def _tcp_address(ip: str) -> str:
    """``tcp://IP:PORT`` where PORT (requests) and PORT+1 (outputs) are free on this node
    now; free until the stages bind them a moment later."""
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    host = f"[{ip}]" if ":" in ip else ip
    for _ in range(50):
        with socket.socket(family) as first, socket.socket(family) as second:
            first.bind((ip, 0))
            port = first.getsockname()[1]
            if port > MAX_PORT:
                continue
            with contextlib.suppress(OSError):
                second.bind((ip, port + 1))
                return f"tcp://{host}:{port}"
    raise EngineStartError(f"no two consecutive free ports on {ip}")


class ReplicaActor:
    """The replica in its Ray worker: its launcher, on a tcp address of this node. A start
    that fails is kept as ``failure`` (the front ends the actor), so the front reads the
    engine's own message rather than Ray's account of a dead actor."""

    def __init__(self, config: bytes) -> None:
        self.node_ip = _ray().util.get_node_ip_address()
        self.engine: Engine | None = None
        self.failure: str | None = None
        try:
            # The GPUs are Ray's choice, in this worker's CUDA_VISIBLE_DEVICES: the stages
            # inherit it, and no device list of the caller's overrides it.
            replica = msgspec.structs.replace(
                EngineConfig.decode(config),
                address=_tcp_address(self.node_ip),
                cuda_visible_devices=None,
            )
            self.engine = Engine(replica, replica=True)
        except EngineStartError as exc:
            self.failure = str(exc)

    def started(self) -> tuple[str | None, str, str, bytes, dict[str, int]]:
        """How the start went: the failure (or None), the node, the engine's address, its
        ``ModelInfo`` (msgpack) and its stages' pids."""
        engine = self.engine
        if engine is None:
            return self.failure, self.node_ip, "", b"", {}
        return None, self.node_ip, engine.address, encoder.encode(engine.model), engine.pids

    def status(self) -> tuple[str | None, str | None, dict[str, int], dict[str, int]]:
        """Why the engine died (or None), the stage it restarts now, restarts, stage pids."""
        engine = self.engine
        assert engine is not None
        return engine.dead, engine.recovering, dict(engine.restarts.total), engine.pids

    def stop_admitting(self) -> None:
        assert self.engine is not None
        self.engine.stop_admitting()

    def abort_unfinished(self) -> None:
        assert self.engine is not None
        self.engine.abort_unfinished()

    def shutdown(self, drain: bool, drain_timeout: float) -> None:
        if self.engine is not None:
            self.engine.shutdown(drain, drain_timeout)


class RayReplica:
    """Replica ``index`` of a data-parallel set, placed by Ray (the module's doc): the
    surface of ``launch.Engine`` that the set uses, its state polled every ``POLL_S``.

    ``num_cpus`` is the replica's share of a node's CPUs (the caller's split). Raises
    ``EngineStartError`` when no node has its resources within ``startup_timeout`` or its
    engine fails to start.
    """

    def __init__(self, config: EngineConfig, index: int, num_cpus: float) -> None:
        ray = _ray()
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.index = index
        self.dead: str | None = None
        self.recovering: str | None = None
        self.restarts = Restarts(0, 1.0)  # its engine's stage restarts (``total``), as polled
        self.pids: dict[str, int] = {}
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self.stopped = threading.Event()  # set once the actor and its bundle are freed
        self._callbacks: list[Callable[[str], None]] = []
        self.actor: Any = None
        num_gpus = gpus_per_replica(config, ray.cluster_resources().get("GPU", 0))
        bundle = {"CPU": num_cpus} | ({"GPU": num_gpus} if num_gpus else {})
        self._group = placement_group([bundle])
        try:
            self._wait_placed(bundle, config.startup_timeout)
            self.actor = (
                ray.remote(ReplicaActor)
                .options(
                    num_cpus=num_cpus,
                    num_gpus=num_gpus,
                    max_concurrency=ACTOR_CONCURRENCY,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(self._group),
                )
                .remote(config.encode())
            )
            self.node_ip, self.address, model, self.pids = self._wait_started(
                config.startup_timeout + START_SLACK_S
            )
        except BaseException:
            self._release()
            raise
        self.model = msgspec.msgpack.decode(model, type=ModelInfo)
        threading.Thread(target=self._watch, name=f"mpengine-ray-dp{index}", daemon=True).start()

    def _wait_placed(self, bundle: dict[str, float], timeout: float) -> None:
        ray = _ray()
        try:
            ray.get(self._group.ready(), timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            raise EngineStartError(
                f"replica {self.index}: no node of the Ray cluster had its resources within "
                f"startup_timeout ({timeout:g} s, --startup-timeout): it asks for "
                f"{_resources(bundle)}; the cluster has {_resources(ray.cluster_resources())} "
                f"({_resources(ray.available_resources())} free)"
            ) from None

    def _wait_started(self, timeout: float) -> tuple[str, str, bytes, dict[str, int]]:
        """Once the engine serves: its node, address, ``ModelInfo`` (msgpack), stage pids."""
        ray = _ray()
        try:
            failure, node_ip, address, model, pids = ray.get(
                self.actor.started.remote(), timeout=timeout
            )
        except ray.exceptions.GetTimeoutError:
            raise EngineStartError(
                f"replica {self.index}: its Ray actor did not start its engine within {timeout:g} s"
            ) from None
        except ray.exceptions.RayActorError as exc:
            raise EngineStartError(
                f"replica {self.index}: its Ray actor died while starting: {exc}"
            ) from None
        if failure is not None:
            raise EngineStartError(f"replica {self.index} (on {node_ip}): {failure}")
        return node_ip, address, model, pids

    def _watch(self) -> None:
        """Poll the actor until the replica dies or is shut down. A timeout or a moment out
        of reach is no death: Ray says when the actor is gone."""
        ray = _ray()
        errors = ray.exceptions
        while not self._closing.wait(POLL_S):
            try:
                dead, self.recovering, self.restarts.total, self.pids = ray.get(
                    self.actor.status.remote(), timeout=CALL_TIMEOUT_S
                )
            except (errors.GetTimeoutError, errors.ActorUnavailableError):
                continue
            except errors.RayError as exc:  # killed, its node lost, this process left Ray
                cause = str(exc).strip().splitlines()[-1:] or [type(exc).__name__]
                dead = f"its Ray actor on {self.node_ip} died: {cause[0]}"
            if self._closing.is_set():
                return
            if dead is not None:
                self._died(dead)
                return

    def _died(self, reason: str) -> None:
        """As an engine's supervisor: the callbacks are told, then the replica is stopped
        (a replica started in its place may need its resources)."""
        with self._lock:
            self.dead = reason
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback(reason)
        self._stop(drain=False, drain_timeout=0.0)

    def on_death(self, callback: Callable[[str], None]) -> None:
        """Call ``callback(reason)`` once, from the watching thread, when the replica dies
        (here and now if it is dead already)."""
        with self._lock:
            if self.dead is None:
                self._callbacks.append(callback)
                return
        callback(self.dead)

    def stop_admitting(self) -> None:
        """As ``Engine.stop_admitting``; nothing to do for an actor that is gone."""
        self._call(self.actor.stop_admitting.remote())

    def abort_unfinished(self) -> None:
        """As ``Engine.abort_unfinished``; nothing to do for an actor that is gone."""
        self._call(self.actor.abort_unfinished.remote())

    def _call(self, ref: Any) -> None:
        ray = _ray()
        with contextlib.suppress(ray.exceptions.RayActorError):
            ray.get(ref, timeout=CALL_TIMEOUT_S)

    def shutdown(self, drain: bool = False, drain_timeout: float = DRAIN_TIMEOUT_S) -> None:
        """Shut the engine down in the actor (after a drain, if asked), then end the actor
        and free its resources. Idempotent; never raises when the actor is gone."""
        with self._lock:
            if self._closing.is_set():
                return
            self._closing.set()
        self._stop(drain, drain_timeout)

    def _stop(self, drain: bool, drain_timeout: float) -> None:
        """Shut the engine down in the actor, then release. Killed at once, the actor would
        take the engine's reaper with it (Ray ends a worker's process group), and an
        engine that died may still be removing its segments."""
        ray = _ray()
        if ray.is_initialized():
            with contextlib.suppress(ray.exceptions.RayError):
                timeout = (drain_timeout if drain else 0.0) + STOP_S
                ray.get(self.actor.shutdown.remote(drain, drain_timeout), timeout=timeout)
        self._release()

    def _release(self) -> None:
        """End the actor (its stages die with it: ``PR_SET_PDEATHSIG``) and its bundle, then
        set ``stopped``. A process that left Ray has neither any more."""
        ray = _ray()
        from ray.util.placement_group import remove_placement_group

        if ray.is_initialized():
            with contextlib.suppress(ray.exceptions.RayError):
                if self.actor is not None:
                    ray.kill(self.actor)
            with contextlib.suppress(ray.exceptions.RayError):
                remove_placement_group(self._group)
        self.stopped.set()

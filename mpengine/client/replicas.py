"""A client's connections to the data-parallel replicas of one engine: ``Replicas``, the
caller-side surface of a ``Connection`` (``route``, ``query``, ``abort_live``, ``close``...)
over one ``Connection`` per replica.

Each request goes to the replica its ``Router`` chooses (``routing.py``), or to the one
the caller pins (``data_parallel_rank``); from then on it belongs to that replica's
connection: its deltas, its abort. A stats query asks every serving replica and sums their
answers (``combined_stats``); the tokenizer comes from any one of them.

A replica leaves the rotation the moment its connection says so (its scheduler's or output
processor's socket dropped, the engine died, or its launcher said so) and rejoins when it
serves again: a connection that ended, and a replica that could not be reached at all,
are tried again every ``RETRY_S`` by a thread of the set. Requests in flight on a replica
whose stage died end as they would with one engine (an error, or recovery).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import msgspec

from mpengine.client.connection import Connection, Sink, after_fork
from mpengine.client.routing import Policy, Router
from mpengine.errors import ClientClosedError, EngineDeadError, InvalidRequestError
from mpengine.protocol import AddRequest, EngineInfo, EngineStats, StatsQuery

logger = logging.getLogger(__name__)

RETRY_S = 2.0  # how often a replica out of reach (or whose engine ended) is tried again
CONNECT_S = 2.0  # one try's handshake deadline (tries stop this soon after close)
# What replicas must agree on to serve as one engine.
SAME_ENGINE = ("model", "tokenizer", "vocab_size", "block_size")


def addresses_of(address: str | Sequence[str]) -> list[str]:
    """The replicas' addresses: a list, or one string of them separated by commas."""
    if not isinstance(address, str | Sequence):
        raise TypeError(f"address must be a str or a list of them, not {type(address).__name__}")
    parts = address.split(",") if isinstance(address, str) else list(address)
    parts = [part.strip() for part in parts if part.strip()]
    if not parts:
        raise ValueError("no engine address given")
    return parts


def check_rank(rank: object, size: int) -> None:
    """A caller's ``data_parallel_rank`` names one of ``size`` replicas."""
    if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < size:
        raise InvalidRequestError(
            f"data_parallel_rank {rank!r}: this engine has {size} replicas (0..{size - 1})"
        )


def combined_stats(parts: Sequence[EngineStats], query_id: int) -> EngineStats:
    """Every replica's stats as the engine's: counts and totals added up (a histogram's
    buckets too), each replica's stages named ``STAGE dpN``."""
    fields: dict[str, Any] = {"query_id": query_id}
    for name in EngineStats.__struct_fields__:
        if name == "query_id":
            continue
        values = [getattr(part, name) for part in parts]
        if name == "stages":
            fields[name] = {
                f"{stage} dp{i}": times for i, v in enumerate(values) for stage, times in v.items()
            }
        elif isinstance(values[0], list):
            width = max(map(len, values))
            fields[name] = [sum(v[k] for v in values if k < len(v)) for k in range(width)]
        else:
            fields[name] = sum(values)
    return EngineStats(**fields)


class Replica:
    """One replica of the set: its address, its connection while it has one, and why it
    has none (or why it does not serve)."""

    def __init__(self, index: int, address: str) -> None:
        self.index = index
        self.address = address
        self.conn: Connection | None = None
        self.error: str | None = None  # why the last try to connect failed
        self.connecting = False  # a try is under way

    @property
    def serving(self) -> bool:
        return self.conn is not None and self.conn.serving

    def problem(self) -> str | None:
        """Why it does not serve (None when it does)."""
        if self.conn is None:
            return f"not connected: {self.error or 'connecting'}"
        return self.conn.problem()


class Replicas:
    """The connections of one client to every replica of an engine (see the module's
    docstring). Caller side as a ``Connection``'s; ``status`` says how each replica is."""

    def __init__(
        self,
        addresses: Sequence[str],
        *,
        timeout: float,
        client_id: str | None,
        auth_token: str | None,
        routing: Policy = "least_outstanding",
    ) -> None:
        self.client_id = client_id or f"client-{uuid.uuid4().hex[:12]}"
        self._named = bool(client_id)
        self._auth_token = auth_token
        self.replicas = [Replica(i, address) for i, address in enumerate(addresses)]
        self._lock = threading.RLock()
        after_fork.add(self)
        self._ending: tuple[type[Exception], str] | None = None
        self._supervised = False
        self._stop = threading.Event()
        self.queries: dict[int, Sink] = {}
        self._query_ids = itertools.count()
        self.info: EngineInfo | None = None
        self._first = threading.Event()
        self._tries = []
        for replica in self.replicas:
            replica.connecting = True
            self._tries.append(
                threading.Thread(
                    target=self._connect_within,
                    args=(replica, timeout),
                    daemon=True,
                    name="mpengine-connect",
                )
            )
            self._tries[-1].start()
        # The first that answers; the others get a moment more, then the thread that
        # retries them (a replica out of reach is not fatal while one serves).
        if not self._first.wait(timeout):
            self._stop.set()
            raise ConnectionError(
                "no replica of the engine could be reached: "
                + "; ".join(f"{r.address}: {r.error or 'no answer'}" for r in self.replicas)
            )
        deadline = time.monotonic() + min(CONNECT_S, timeout)
        for replica, attempt in zip(self.replicas, self._tries, strict=True):
            attempt.join(max(0.0, deadline - time.monotonic()))
            if replica.conn is None:
                logger.warning(
                    "replica %d (%s) is out of reach, tried again every %g s: %s",
                    replica.index,
                    replica.address,
                    RETRY_S,
                    replica.error or "no answer yet",
                )
        self.router = Router(routing, self.info.block_size)  # type: ignore[union-attr]
        self._retry = threading.Thread(
            target=self._reconnect, name=f"mpengine-client-replicas-{self.client_id}", daemon=True
        )
        self._retry.start()

    def _new_locks(self) -> None:
        self._lock = threading.RLock()

    # -- connecting ----------------------------------------------------------------------

    def _connect_within(self, replica: Replica, timeout: float) -> None:
        """Try to connect ``replica`` until ``timeout`` (each try a short one, so that a
        closed client's tries end soon: a socket left connecting would hold up the
        process's exit)."""
        deadline = time.monotonic() + timeout
        while not self._stop.is_set() and (left := deadline - time.monotonic()) > 0:
            replica.connecting = True
            self._connect(replica, min(CONNECT_S, left))
            if replica.conn is not None:
                return

    def _connect(self, replica: Replica, timeout: float) -> None:
        """Connect ``replica`` (an engine that serves the same model as the others); on
        failure say why in ``replica.error``."""
        try:
            conn = Connection(
                replica.address,
                timeout=timeout,
                client_id=self.client_id if self._named else None,
                auth_token=self._auth_token,
            )
        except Exception as exc:
            replica.error = f"{type(exc).__name__}: {exc}"
            replica.connecting = False
            return
        conn.index = replica.index
        with self._lock:
            info = self.info or conn.info
            differ = [f for f in SAME_ENGINE if getattr(conn.info, f) != getattr(info, f)]
            if differ or self._ending is not None or self._stop.is_set():
                conn.close(0)
                if differ:
                    replica.error = "it serves another model: " + ", ".join(
                        f"{f} {getattr(conn.info, f)!r}, not {getattr(info, f)!r}" for f in differ
                    )
            else:
                if self._supervised:
                    conn.mark_supervised()
                replica.conn, replica.error, self.info = conn, None, info
                self._first.set()
            replica.connecting = False

    def _reconnect(self) -> None:
        """Try the replicas out of reach, and those whose engine ended, again."""
        while not self._stop.wait(RETRY_S):
            for replica in self.replicas:
                conn = replica.conn
                if replica.connecting:
                    continue
                if conn is None or conn.dead is not None:
                    if self._stop.is_set():
                        return
                    if conn is not None:
                        replica.error = conn.dead
                    replica.connecting = True
                    self._connect(replica, CONNECT_S)
                    if replica.conn is not None and replica.conn is not conn:
                        logger.info("replica %d (%s) serves again", replica.index, replica.address)

    # -- caller side ---------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._ending is not None

    def status(self) -> list[tuple[Replica, str | None]]:
        """Each replica and why it does not serve (None: it serves)."""
        return [(replica, replica.problem()) for replica in self.replicas]

    def route(self, request: AddRequest, rank: int | None) -> Connection:
        """The connection of the replica that runs ``request``: the pinned one (``rank``),
        else the router's choice among those serving."""
        if self._ending is not None:
            kind, reason = self._ending
            raise kind(reason)
        if rank is not None:
            check_rank(rank, len(self.replicas))
            replica = self.replicas[rank]
            if not replica.serving:
                raise EngineDeadError(f"replica {rank} is not serving: {replica.problem()}")
            return replica.conn  # type: ignore[return-value]
        with self._lock:
            loads = [len(r.conn.sinks) if r.serving else None for r in self.replicas]  # type: ignore[union-attr]
            try:
                chosen = self.router.choose(request.prompt_token_ids.numpy(), loads)
            except ValueError:
                raise EngineDeadError(self._none_serving()) from None
        return self.replicas[chosen].conn  # type: ignore[return-value]

    def _none_serving(self) -> str:
        problems = "; ".join(f"replica {r.index}: {p}" for r, p in self.status())
        return f"no replica of the engine is serving ({problems})"

    def abort_live(self, request_ids: Sequence[str]) -> None:
        for replica in self.replicas:
            if replica.conn is not None:
                replica.conn.abort_live(request_ids)

    def query(
        self, make: Callable[[int], msgspec.Struct], sink: Sink, rank: int | None = None
    ) -> int:
        """Send ``make(query_id)`` to the pinned replica, or (stats) to every serving one,
        their answers summed, or (the tokenizer) to one; the reply goes to ``sink``."""
        if rank is not None:
            check_rank(rank, len(self.replicas))
            serving = [self.replicas[rank]]
        else:
            serving = [r for r in self.replicas if r.serving]
            if not serving:
                raise EngineDeadError(self._none_serving())
            if make is not StatsQuery:
                serving = serving[:1]
        query_id = next(self._query_ids)
        replies: dict[int, Any] = {}

        def answer(index: int) -> Sink:
            def receive(item: Any) -> None:
                with self._lock:
                    replies[index] = item
                    if len(replies) < len(serving):
                        return
                    done = self.queries.pop(query_id, None)
                if done is not None:
                    done(self._reply(replies, query_id))

            return receive

        with self._lock:
            self.queries[query_id] = sink
        try:
            for replica in serving:
                if replica.conn is None:
                    raise EngineDeadError(f"replica {replica.index} is not serving")
                replica.conn.query(make, answer(replica.index))
        except BaseException:
            self.queries.pop(query_id, None)
            raise
        return query_id

    @staticmethod
    def _reply(replies: dict[int, Any], query_id: int) -> Any:
        """One answer of those of several replicas: the only one, or their stats summed
        (a replica that failed to answer left out, unless all did)."""
        answers = [replies[i] for i in sorted(replies)]
        good = [a for a in answers if not isinstance(a, BaseException)]
        if not good:
            return answers[0]
        if len(answers) == 1:
            return answers[0]
        return combined_stats(good, query_id)

    def close(self, timeout: float = 5.0) -> None:
        with self._lock:
            if self._ending is None:
                self._ending = (ClientClosedError, "the client was closed")
        self._stop.set()
        for thread in [*self._tries, self._retry]:  # (their sockets closed with them)
            thread.join(CONNECT_S + 1.0)
        for replica in self.replicas:
            if replica.conn is not None:
                replica.conn.close(timeout)

    def mark_supervised(self) -> None:
        with self._lock:
            self._supervised = True
            for replica in self.replicas:
                if replica.conn is not None:
                    replica.conn.mark_supervised()

    def engine_died(self, reason: str, replica: int | None = None) -> None:
        """The engine (``replica`` None), or one replica of it, died: what it ran fails now
        with ``EngineDeadError(reason)``; a replica alone is tried again later."""
        if replica is None:
            with self._lock:
                if self._ending is None:
                    self._ending = (EngineDeadError, reason)
            self._stop.set()
        for one in self.replicas if replica is None else [self.replicas[replica]]:
            if one.conn is not None:
                one.conn.engine_died(reason)

    def readdress(self, index: int, address: str) -> None:
        """Replica ``index`` serves at ``address`` now: connect there (the retry thread
        does, once its old connection has ended)."""
        replica = self.replicas[index]
        if replica.address != address:
            replica.address = address
            if replica.conn is not None:
                replica.conn.engine_died(f"replica {index} moved to {address}")

    def replica_recovering(self, stage: str | None, replica: int | None = None) -> None:
        for one in self.replicas if replica is None else [self.replicas[replica]]:
            if one.conn is not None:
                one.conn.replica_recovering(stage)

    def scheduler_lost(self, reason: str, replica: int | None = None) -> None:
        for one in self.replicas if replica is None else [self.replicas[replica]]:
            if one.conn is not None:
                one.conn.scheduler_lost(reason)

    def abandon(self) -> None:
        self._stop.set()
        for replica in self.replicas:
            if replica.conn is not None:
                replica.conn.abandon()

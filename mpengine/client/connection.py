"""A client's connection to an engine: both dealers and the one I/O thread that owns them
(ZMQ sockets are not thread-safe).

Callers never touch a socket: they queue frames in an outbox and wake the thread through a
pipe; the thread hands deltas and replies to per-request *sinks* (callables). One failing
delivery (a closed event loop, a frame that does not decode) fails only the requests
involved. A disconnect of the scheduler's socket means the engine died or restarts its
scheduler: every pending request fails with ``EngineDeadError``; the output socket alone
goes down while the engine restarts its output processor. A connection waits at most
``STAGE_RETURN_S`` for a stage to come back. When the thread stops (close,
engine death, or the client object garbage-collected) it aborts what is pending, in frames
of at most ``ABORT_CHUNK_BYTES``, and closes its own sockets.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import select
import threading
import time
import uuid
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import msgspec
import zmq

from mpengine.addresses import connectable, output_address
from mpengine.client.sockets import Deadline, Dealer, context
from mpengine.errors import (
    ClientClosedError,
    EngineDeadError,
    InvalidRequestError,
    ProtocolError,
)
from mpengine.limits import ABORT_CHUNK_BYTES
from mpengine.protocol import (
    Abort,
    AddRequest,
    EngineInfo,
    EngineStats,
    Hello,
    OutputBatch,
    RequestError,
    TokenizerFile,
    encoder,
    output_reply_decoder,
    scheduler_reply_decoder,
)

logger = logging.getLogger(__name__)

Sink = Callable[[Any], None]  # receives a delta or reply, or an exception to raise

POLL_MS = 100  # the I/O thread's longest sleep: how soon it sees a dropped client
ABORT_LINGER_MS = 2000  # how long closed sockets keep trying to deliver the last aborts
MAX_FRAMES_PER_TURN = 1000  # frames read from one socket before serving the others
# A client made by a launcher in this process, seeing the engine close its connection,
# waits this long for the launcher's word on why (a stage's error) before a generic one.
LAUNCHER_WORD_S = 1.0
MAX_CLIENT_ID_BYTES = 200  # a caller's client name (ZMQ routing ids: 255 bytes at most)
# How long a connection to a stage may stay down (the engine restarts a stage that died:
# it serves again within seconds, the model loaded again) before the engine counts as dead.
STAGE_RETURN_S = 60.0


def abort_frames(request_ids: Iterable[str], max_bytes: int = ABORT_CHUNK_BYTES) -> list[bytes]:
    """``Abort`` frames for ``request_ids``, each at most ``max_bytes`` (or one id)."""
    frames: list[bytes] = []
    chunk: list[str] = []
    size = 16  # tag and array headers
    for request_id in request_ids:
        cost = len(request_id.encode()) + 5  # msgpack str header
        if chunk and size + cost > max_bytes:
            frames.append(encoder.encode(Abort(chunk)))
            chunk, size = [], 16
        chunk.append(request_id)
        size += cost
    if chunk:
        frames.append(encoder.encode(Abort(chunk)))
    return frames


def request_error(error: RequestError) -> Exception:
    if error.kind == "unauthorized":
        return PermissionError(error.message)
    return InvalidRequestError(error.message, error.kind)


def ids_in_bad_frame(frame: bytes) -> tuple[list[str], list[int]]:
    """The wire ids and query ids a frame that failed to decode was about, if its
    msgpack can be read at all (array-like structs: ``[tag, first field, ...]``)."""
    try:
        obj = msgspec.msgpack.decode(frame)
    except msgspec.DecodeError:
        return [], []
    if not isinstance(obj, list) or len(obj) < 2:
        return [], []
    tag, first = obj[0], obj[1]
    if tag == "OutputBatch" and isinstance(first, list):
        ids = [d[1] for d in first if isinstance(d, list) and len(d) > 1 and isinstance(d[1], str)]
        return ids, []
    if tag == "RequestError" and isinstance(first, str) and first:
        return [first], []
    if tag in ("EngineStats", "TokenizerFile") and isinstance(first, int):
        return [], [first]
    return [], []


# Objects whose locks a forked child makes anew: a lock that another thread of the parent
# held at the fork stays held in the child forever (its use there must fail, not hang).
after_fork: weakref.WeakSet = weakref.WeakSet()


def _reinit_locks() -> None:
    for obj in list(after_fork):
        obj._new_locks()


os.register_at_fork(after_in_child=_reinit_locks)


class Connection:
    """Both dealers of one client and the I/O thread that owns them.

    Caller side (any thread): ``submit``, ``send``, ``abort``, ``query``, ``close``.
    Everything a caller sends goes through the outbox; only the I/O thread touches sockets.
    ``abandon`` (the client object's finalizer) only sets a flag.

    The engine knows each submission by a wire id of its own (the caller's id and a
    number): a caller that gave up on a request may reuse its id at once, while the engine
    still ends the old one (whose late outputs find no receiver), and an id is free again
    as soon as its request finished here, before the engine has let it go.
    """

    def __init__(
        self, address: str, *, timeout: float, client_id: str | None, auth_token: str | None
    ) -> None:
        if client_id and len(client_id.encode()) > MAX_CLIENT_ID_BYTES:
            raise ValueError(f"client_id must be at most {MAX_CLIENT_ID_BYTES} bytes of UTF-8")
        self.client_id = client_id or f"client-{uuid.uuid4().hex[:12]}"
        # Each connection routes under an id of its own, the caller's name plus a nonce: the
        # engine forgets a connection found gone (and drops what it still queues of it), so
        # a new connection under that name must never be taken for the old one. ("" is no
        # name: a random one.)
        self.routing_id = (
            f"{self.client_id}.{uuid.uuid4().hex[:8]}" if client_id else self.client_id
        )
        self.address = connectable(address)
        self.sinks: dict[str, Sink] = {}  # wire id -> where its deltas go
        self.live: dict[str, str] = {}  # caller's request id -> wire id, until it ends here
        self._wire_ids = itertools.count()
        self.queries: dict[int, Sink] = {}  # query id -> where the reply goes
        self.dead: str | None = None  # why the engine is gone, once it is
        self._query_ids = itertools.count()
        self._outbox: deque[bytes] = deque()
        # Guards _ending, the wake pipe and ``live``; reentrant: a stream dropped in a
        # reference cycle is closed by the collector in whatever thread runs it, maybe one
        # holding the lock in ``submit`` (its ``forget`` then takes it again).
        self._lock = threading.RLock()
        after_fork.add(self)
        self._ending: tuple[type[Exception], str] | None = None  # set once: no more sends
        self._abandoned = False
        self.supervised = False  # see mark_supervised
        # Since when the connection to the scheduler, or to the output processor, is down.
        self._requests_down: float | None = None
        self._outputs_down: float | None = None
        self._scheduler_lost: str | None = None  # why, as the launcher said
        self._pid = os.getpid()
        self.index = 0  # which replica of its engine (``Replicas``)
        self.recovering: str | None = None  # the stage its launcher restarts now
        deadline = Deadline(timeout)
        hello = encoder.encode(Hello(self.routing_id))
        ctx = context()
        dealers: list[Dealer] = []
        try:
            dealers.append(Dealer(ctx, self.address, self.routing_id, auth_token))
            info = dealers[0].handshake(hello, scheduler_reply_decoder(), deadline)
            if not isinstance(info, EngineInfo):
                raise ConnectionError(f"{self.address} answered hello with {type(info).__name__}")
            self.info = info
            self.output_address = output_address(self.address, info.output_address)
            dealers.append(Dealer(ctx, self.output_address, self.routing_id, auth_token))
            dealers[1].handshake(hello, output_reply_decoder(), deadline)
        except BaseException:
            for dealer in dealers:
                dealer.close()
            raise
        self._requests, self._outputs = dealers
        limit = info.max_request_bytes // 2 if info.max_request_bytes else ABORT_CHUNK_BYTES
        self.abort_chunk_bytes = max(512, min(ABORT_CHUNK_BYTES, limit))
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self.thread = threading.Thread(
            target=self._run, name=f"mpengine-client-io-{self.client_id}", daemon=True
        )
        self.thread.start()

    # -- caller side ---------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        """No more requests can be sent (closed, dropped, or the engine is gone)."""
        return self._ending is not None

    @property
    def serving(self) -> bool:
        """Whether new requests may come here: open, and both stages connected."""
        down = self._requests_down is not None or self._outputs_down is not None
        return self._ending is None and not down and self.recovering is None

    def problem(self) -> str | None:
        """Why it does not serve (None when it does)."""
        if self._ending is not None:
            return self.dead or self._ending[1]
        if self._requests_down is not None:
            return "its scheduler is down (it restarts, or the engine died)"
        if self._outputs_down is not None:
            return "its output processor is down (it restarts)"
        if self.recovering is not None:
            return f"its {self.recovering} stage died and restarts"
        return None

    def route(self, request: AddRequest, rank: int | None) -> Connection:
        """Where ``request`` goes: here (a replica set chooses among its connections);
        ``rank`` pins a data-parallel replica, of which an engine alone has one."""
        if rank not in (None, 0) or isinstance(rank, bool):
            raise InvalidRequestError(
                f"data_parallel_rank {rank!r}: this engine has one replica (0)"
            )
        return self

    def _enqueue(self, frames: Iterable[bytes]) -> None:
        """Queue frames for the I/O thread and wake it; the caller holds the lock."""
        if self._pid != os.getpid():
            raise ClientClosedError("this client was created before a fork: make a new one")
        if self._ending is not None:
            kind, reason = self._ending
            raise kind(reason)
        self._outbox.extend(frames)
        with contextlib.suppress(BlockingIOError):  # a full pipe wakes the thread anyway
            os.write(self._wake_w, b"\0")

    def _encode(self, msg: msgspec.Struct) -> bytes:
        frame = encoder.encode(msg)
        limit = self.info.max_request_bytes
        if limit and len(frame) > limit:
            raise InvalidRequestError(
                f"request of {len(frame)} bytes exceeds the engine's max_request_bytes ({limit})",
                "too_large",
            )
        return frame

    def send(self, msg: msgspec.Struct) -> None:
        """Send one message to the scheduler."""
        frame = self._encode(msg)
        with self._lock:
            self._enqueue((frame,))

    def submit(self, request: AddRequest, sink: Sink) -> str:
        """Send a request; its deltas (or an exception) will be passed to ``sink``. Returns
        its wire id."""
        request_id = request.request_id
        wire_id = f"{request_id}#{next(self._wire_ids)}"
        frame = self._encode(msgspec.structs.replace(request, request_id=wire_id))
        with self._lock:
            if request_id in self.live:
                raise InvalidRequestError(f"request id {request_id!r} is already in use")
            self.live[request_id] = wire_id
            self.sinks[wire_id] = sink  # before the frame can go out
            try:
                self._enqueue((frame,))
            except BaseException:
                del self.sinks[wire_id], self.live[request_id]
                raise
        return wire_id

    def forget(self, request_id: str, wire_id: str) -> None:
        """Deliver nothing more for this request; its id is free again."""
        with self._lock:
            self.sinks.pop(wire_id, None)
            if self.live.get(request_id) == wire_id:
                del self.live[request_id]

    def abort_live(self, request_ids: Sequence[str]) -> None:
        """Abort the requests running under these ids of the caller's (unknown ones, and
        those already ended, are ignored)."""
        with self._lock:
            wire_ids = [w for r in request_ids if (w := self.live.get(r)) is not None]
        self.abort(wire_ids)

    def abort(self, wire_ids: Sequence[str]) -> None:
        """Abort the requests sent under these wire ids on the engine (in frames of bounded
        size; their final deltas still come); nothing to do once the connection is closed."""
        if wire_ids:
            with self._lock:
                if self._ending is None:
                    self._enqueue(abort_frames(wire_ids, self.abort_chunk_bytes))

    def query(
        self, make: Callable[[int], msgspec.Struct], sink: Sink, rank: int | None = None
    ) -> int:
        """Send ``make(query_id)``; the engine's reply (or an exception) goes to ``sink``.
        The caller removes ``queries[query_id]`` when it stops waiting. (``rank``: as
        ``route``'s.)"""
        if rank is not None:
            self.route(None, rank)  # type: ignore[arg-type]
        query_id = next(self._query_ids)
        frame = encoder.encode(make(query_id))
        with self._lock:
            self.queries[query_id] = sink
            try:
                self._enqueue((frame,))
            except BaseException:
                del self.queries[query_id]
                raise
        return query_id

    def close(self, timeout: float = 5.0) -> None:
        """Abort pending requests (they fail with ``ClientClosedError``) and stop the
        I/O thread, waiting for it at most ``timeout`` seconds."""
        self._end(ClientClosedError, "the client was closed")
        if threading.current_thread() is not self.thread:
            self.thread.join(timeout)
            if self.thread.is_alive():
                logger.warning("client %s: the I/O thread did not stop in time", self.client_id)

    def mark_supervised(self) -> None:
        """The engine's launcher runs in this process and calls ``engine_died`` when a stage
        dies: seeing the engine close the connection, wait a moment for its word on why."""
        self.supervised = True

    def engine_died(self, reason: str, replica: int | None = None) -> None:
        """The launcher saw the engine die (any thread): fail everything pending now.
        (``replica``: which one of a replica set, here always this one.)"""
        self._end(EngineDeadError, reason)

    def replica_recovering(self, stage: str | None, replica: int | None = None) -> None:
        """The launcher restarts ``stage`` of this engine (None: it is back)."""
        self.recovering = stage

    def scheduler_lost(self, reason: str, replica: int | None = None) -> None:
        """The launcher saw the scheduler die and restarts the engine (any thread): what
        is pending fails (``_scheduler_gone``) with ``reason``."""
        with self._lock:
            self._scheduler_lost = reason
            with contextlib.suppress(BlockingIOError, OSError):
                os.write(self._wake_w, b"\0")

    def abandon(self) -> None:
        """The client object was garbage-collected. Runs in whatever thread the collector
        runs in, maybe inside a send holding the lock: only sets a flag for the I/O thread."""
        self._abandoned = True

    def _new_locks(self) -> None:
        self._lock = threading.RLock()

    def _end(self, kind: type[Exception], reason: str) -> None:
        with self._lock:
            if self._ending is None:
                self._ending = (kind, reason)
                with contextlib.suppress(BlockingIOError, OSError):
                    os.write(self._wake_w, b"\0")

    # -- the I/O thread ------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._serve()
        except BaseException as exc:
            logger.exception("client %s: the I/O thread failed", self.client_id)
            self._end(EngineDeadError, f"the client's I/O thread failed: {exc!r}")
        finally:
            self._finish()

    def _serve(self) -> None:
        requests, outputs = self._requests, self._outputs
        replies, deltas = scheduler_reply_decoder(), output_reply_decoder()
        poller = zmq.Poller()
        for sock in (requests.sock, outputs.sock, requests.monitor, outputs.monitor):
            poller.register(sock, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        while True:
            if self._abandoned:  # (its finalizer also runs at exit, the client in use)
                self._end(
                    ClientClosedError,
                    "the client was not closed, and was garbage-collected or the program exits",
                )
            if self._ending is not None:
                return
            events = dict(poller.poll(POLL_MS))
            if self._wake_r in events:
                with contextlib.suppress(BlockingIOError):
                    while os.read(self._wake_r, 4096):
                        pass
            self._flush()
            if outputs.sock in events:
                self._receive(outputs.sock, deltas, self._on_output)
            if requests.sock in events:
                self._receive(requests.sock, replies, self._on_reply)
            if requests.monitor in events and (up := requests.link()) is not None:
                if up:
                    self._requests_down = None
                else:
                    self._scheduler_gone()
            if outputs.monitor in events and (up := outputs.link()) is not None:
                # The output processor alone: the engine restarts it, and its requests go
                # on (the scheduler's connection says when the engine died).
                self._outputs_down = None if up else time.monotonic()
            for since, stage in (
                (self._requests_down, "scheduler"),
                (self._outputs_down, "output"),
            ):
                if since and time.monotonic() - since > STAGE_RETURN_S:
                    self._end(
                        EngineDeadError,
                        f"the engine closed its connection (it stopped or died): its {stage} "
                        f"stage did not come back in {STAGE_RETURN_S:g} s",
                    )
            self._flush()  # aborts of requests whose delivery failed

    def _scheduler_gone(self) -> None:
        """The scheduler's connection dropped: the engine died, or restarts its scheduler.
        Either way the requests it held are gone: they fail now, to be retried. A launcher
        in this process says which (``engine_died``); other clients keep the connection for
        a new scheduler, for at most ``STAGE_RETURN_S``."""
        if self.supervised:
            self._await_launcher()
            if self._ending is not None:
                return
        why = self._scheduler_lost or "it died, or the engine restarts it"
        self._scheduler_lost = None
        error = EngineDeadError(
            f"the engine's scheduler stopped ({why}), and the requests it held with it: retry them"
        )
        for wire_id in list(self.sinks):
            self._deliver(wire_id, error, final=True)
        for query_id in list(self.queries):
            self._call(self.queries.pop(query_id), error)
        self._requests_down = time.monotonic()

    def _await_launcher(self) -> None:
        """Wait (a little) for the launcher's ``engine_died``, which says why."""
        until = time.monotonic() + LAUNCHER_WORD_S
        while self._ending is None and self._scheduler_lost is None:
            if (left := until - time.monotonic()) <= 0:
                break
            select.select([self._wake_r], [], [], left)
            with contextlib.suppress(BlockingIOError):
                while os.read(self._wake_r, 4096):  # (also woken by sends meanwhile)
                    pass

    def _flush(self) -> bool:
        """Send the outbox to the scheduler; whether anything was sent."""
        sent = False
        while self._outbox:
            try:
                self._requests.sock.send(self._outbox[0], zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return sent  # retried on the next turn
            except zmq.ZMQError as exc:
                logger.warning("client %s: a frame could not be sent: %s", self.client_id, exc)
            self._outbox.popleft()
            sent = True
        return sent

    def _receive(
        self, sock: zmq.Socket, decoder: msgspec.msgpack.Decoder, handle: Callable[[Any], None]
    ) -> None:
        """Handle the frames waiting on ``sock``; one that fails fails only its requests."""
        for _ in range(MAX_FRAMES_PER_TURN):
            try:
                frame = sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                handle(decoder.decode(frame))
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                self._undecodable(frame, exc)
            except Exception:
                logger.exception("client %s: failed to handle a frame", self.client_id)

    def _undecodable(self, frame: bytes, exc: Exception) -> None:
        wire_ids, query_ids = ids_in_bad_frame(frame)
        logger.warning(
            "client %s: dropped a frame from the engine that does not decode (%s); "
            "failing requests %s and queries %s",
            self.client_id,
            exc,
            wire_ids,
            query_ids,
        )
        error = ProtocolError(f"a reply from the engine could not be decoded: {exc}")
        for wire_id in wire_ids:
            self._deliver(wire_id, error, final=True)
            self._outbox.extend(abort_frames([wire_id], self.abort_chunk_bytes))
        for query_id in query_ids:
            if (sink := self.queries.pop(query_id, None)) is not None:
                self._call(sink, error)

    def _on_output(self, msg: object) -> None:
        if isinstance(msg, OutputBatch):
            for delta in msg.deltas:
                self._deliver(delta.request_id, delta)
        elif isinstance(msg, RequestError):
            self._on_error(msg)

    def _on_reply(self, msg: object) -> None:
        if isinstance(msg, RequestError):
            self._on_error(msg)
        elif isinstance(msg, EngineStats | TokenizerFile) and (
            sink := self.queries.pop(msg.query_id, None)
        ):
            self._call(sink, msg)

    def _on_error(self, error: RequestError) -> None:
        if error.request_id:
            self._deliver(error.request_id, request_error(error), final=True)
        else:
            logger.warning("client %s: the engine says: %s", self.client_id, error.message)

    def _deliver(self, wire_id: str, item: object, final: bool = False) -> None:
        """Hand ``item`` to the sink of the request sent under ``wire_id`` (the engine names
        requests by their wire ids); ``final``: nothing more will come for it."""
        sink = self.sinks.pop(wire_id, None) if final else self.sinks.get(wire_id)
        if sink is not None and not self._call(sink, item):
            # Nobody can receive this request's outputs (its event loop is closed...).
            logger.warning("client %s: aborting request %r", self.client_id, wire_id)
            self.forget(wire_id.rpartition("#")[0], wire_id)
            self._outbox.extend(abort_frames([wire_id], self.abort_chunk_bytes))

    def _call(self, sink: Sink, item: object) -> bool:
        try:
            sink(item)
            return True
        except Exception:
            logger.warning("client %s: a receiver failed", self.client_id, exc_info=True)
            return False

    def _finish(self) -> None:
        """Last act of the I/O thread: abort what is pending (if the engine lives), fail
        every waiter, close the sockets."""
        with self._lock:
            if self._ending is None:
                self._ending = (EngineDeadError, "the client's I/O thread stopped")
            os.close(self._wake_r)
            os.close(self._wake_w)
        kind, reason = self._ending
        sinks, self.sinks = self.sinks, {}
        queries, self.queries = self.queries, {}
        linger = 0
        if kind is EngineDeadError:
            self.dead = reason
            self._outbox.clear()
        else:
            self._outbox.extend(abort_frames(list(sinks), self.abort_chunk_bytes))
            if self._flush():
                linger = ABORT_LINGER_MS
        for sink in (*sinks.values(), *queries.values()):
            self._call(sink, kind(reason))
        self._requests.close(linger)
        self._outputs.close()

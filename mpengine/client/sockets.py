"""One DEALER socket to one engine edge (``Dealer``), and what it is built on: the
process's one ZMQ context and deadlines.

A dealer says hello (``Hello`` -> ``EngineInfo`` from the scheduler, ``Hello`` -> ``Hello``
from the output processor) and turns a refused handshake into a clear error
(``PermissionError`` for a wrong or missing auth token). Every client of a process uses one
ZMQ context that is never terminated, so no garbage collection or interpreter exit can
block on it; sockets are closed by the thread that owns them.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import uuid
from typing import Any

import msgspec
import zmq
from zmq.utils.monitor import recv_monitor_message

from mpengine.addresses import split_tcp
from mpengine.auth import secure_client
from mpengine.protocol import RequestError

TCP_HEARTBEAT_MS = 2000  # ZMTP pings: a vanished remote engine counts as a disconnect...
TCP_HEARTBEAT_TIMEOUT_MS = 20000  # ...after this long without an answer
MONITOR_EVENTS = (
    zmq.EVENT_DISCONNECTED
    | zmq.EVENT_HANDSHAKE_SUCCEEDED
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)
HELLO_RETRY_S = 0.1  # the first wait for a hello's answer before connecting again
HELLO_SEND_POLL_S = 0.01  # how often a hello no connection takes yet is tried again
HELLO_RETRY_MAX_S = 2.0


_shared_context: zmq.Context | None = None
_shared_context_pid = 0
_shared_context_lock = threading.Lock()


def context() -> zmq.Context:
    """The process-wide ZMQ context of every client: created on first use (again in a
    forked child), never terminated, so nothing ever waits in ``Context.term()``."""
    global _shared_context, _shared_context_pid
    with _shared_context_lock:
        if _shared_context is None or _shared_context_pid != os.getpid():
            _shared_context = zmq.Context(io_threads=1)
            _shared_context_pid = os.getpid()
        return _shared_context


class Deadline:
    """A point in time some call must finish by (none when ``timeout`` is None, or longer
    than a thread can wait: ``math.inf`` is no deadline either)."""

    __slots__ = ("at", "timeout")

    def __init__(self, timeout: float | None) -> None:
        self.timeout = timeout
        never = timeout is None or timeout >= threading.TIMEOUT_MAX
        self.at = None if never else time.monotonic() + timeout

    def remaining(self) -> float | None:
        return None if self.at is None else max(0.0, self.at - time.monotonic())

    @property
    def passed(self) -> bool:
        return self.at is not None and time.monotonic() >= self.at

    def error(self, what: str) -> TimeoutError:
        return TimeoutError(f"{what} within {self.timeout:g} s")


class Dealer:
    """A DEALER socket to one engine edge under the client id, and a monitor of its
    connection events (handshake failures, disconnects)."""

    def __init__(
        self, ctx: zmq.Context, address: str, client_id: str, auth_token: str | None
    ) -> None:
        self.address = address
        self.secure = bool(auth_token)
        self.sock = ctx.socket(zmq.DEALER)
        self.monitor: zmq.Socket | None = None
        try:
            self.sock.setsockopt(zmq.ROUTING_ID, client_id.encode())
            self.sock.setsockopt(zmq.LINGER, 0)
            self.sock.setsockopt(zmq.SNDHWM, 0)
            self.sock.setsockopt(zmq.RCVHWM, 0)
            tcp = split_tcp(address)
            if tcp is not None:
                self.sock.setsockopt(zmq.HEARTBEAT_IVL, TCP_HEARTBEAT_MS)
                self.sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, TCP_HEARTBEAT_TIMEOUT_MS)
                if tcp[0].startswith("["):
                    self.sock.setsockopt(zmq.IPV6, 1)
            if auth_token:
                secure_client(self.sock, auth_token)
            # Our own endpoint name (pyzmq's is derived from a reusable file descriptor),
            # connected before the socket is, so no handshake event is missed.
            endpoint = f"inproc://mpengine-monitor-{uuid.uuid4().hex}"
            self.sock.monitor(endpoint, MONITOR_EVENTS)
            self.monitor = ctx.socket(zmq.PAIR)
            self.monitor.setsockopt(zmq.LINGER, 0)
            self.monitor.connect(endpoint)
            self.sock.connect(address)
        except BaseException:
            self.close()
            raise

    def handshake(self, hello: bytes, decoder: msgspec.msgpack.Decoder, deadline: Deadline) -> Any:
        """Send ``hello`` and return the engine's answer; raise ``ConnectionError`` (or
        ``PermissionError`` when the engine refused the auth token) if there is none."""
        assert self.monitor is not None
        # Never a blocking send: a DEALER with no connection to the engine (one that hung up
        # on a failed handshake) blocks until it has one, past any deadline.
        sent = self._try_send(hello)
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self.monitor, zmq.POLLIN)
        # An engine ignores a connection under a routing id another one holds (two clients
        # given the same id: not this library's, which adds a nonce): without an answer,
        # connect again (and say hello again) after 0.1 s, then twice as long each time.
        retry_s, retry_at = HELLO_RETRY_S, time.monotonic() + HELLO_RETRY_S
        while True:
            remaining = deadline.remaining()
            if remaining is None:  # (no deadline: retry until an engine answers)
                remaining = HELLO_RETRY_MAX_S
            elif remaining <= 0:
                raise ConnectionError(
                    f"no answer from an engine at {self.address} within {deadline.timeout:g} s:"
                    " is it running there?"
                )
            if time.monotonic() >= retry_at:
                with contextlib.suppress(zmq.ZMQError):  # (not connected: ENOENT)
                    self.sock.disconnect(self.address)
                self.sock.connect(self.address)
                sent = self._try_send(hello)
                retry_s = min(2 * retry_s, HELLO_RETRY_MAX_S)
                retry_at = time.monotonic() + retry_s
            elif not sent:
                sent = self._try_send(hello)
            wait_s = min(remaining, max(0.0, retry_at - time.monotonic()))
            if not sent:
                wait_s = min(wait_s, HELLO_SEND_POLL_S)
            events = dict(poller.poll(max(1, int(wait_s * 1000))))
            if self.sock in events:
                frame = self.sock.recv()
                try:
                    reply = decoder.decode(frame)
                except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                    raise ConnectionError(
                        f"the peer at {self.address} is not a compatible mpengine engine: "
                        f"its answer does not decode ({exc})"
                    ) from None
                if isinstance(reply, RequestError):
                    message = f"the engine at {self.address} refused the connection: "
                    if reply.kind == "unauthorized":
                        raise PermissionError(message + reply.message)
                    raise ConnectionError(message + reply.message)
                return reply
            if self.monitor in events:
                for event, value in self.events():
                    if failure := self._handshake_failure(event, value):
                        raise failure

    def _try_send(self, frame: bytes) -> bool:
        try:
            self.sock.send(frame, zmq.NOBLOCK)
        except zmq.Again:
            return False
        return True

    def _handshake_failure(self, event: int, value: int) -> Exception | None:
        where = f"the engine at {self.address}"
        if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            return PermissionError(f"{where} refused the auth token")
        if event not in (zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL):
            return None
        if value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
            if self.secure:
                return PermissionError(
                    f"{where} refused the auth token: it does not use one (connect without)"
                )
            return PermissionError(
                f"{where} refused the connection: it requires an auth token (auth_token=...)"
            )
        if self.secure:  # a wrong token derives a wrong server key: the engine hangs up
            return PermissionError(
                f"{where} refused the auth token: a wrong token, or the engine uses none"
            )
        # A CURVE server may hang up on a plain client before the mechanisms are compared.
        return PermissionError(
            f"{where} refused the connection (the ZMQ handshake failed, error {value}): "
            "it probably requires an auth token (auth_token=...)"
        )

    def events(self) -> list[tuple[int, int]]:
        """The monitor events waiting now, as ``(event, value)`` pairs."""
        assert self.monitor is not None
        events = []
        while True:
            try:
                msg = recv_monitor_message(self.monitor, zmq.NOBLOCK)
            except zmq.Again:
                return events
            events.append((int(msg["event"]), int(msg["value"])))

    def link(self) -> bool | None:
        """Whether the connection is up (False: it went down) as of the latest of the
        events waiting now; None when none says."""
        state = None
        for event, _ in self.events():
            if event == zmq.EVENT_DISCONNECTED:
                state = False
            elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                state = True
        return state

    def close(self, linger_ms: int = 0) -> None:
        """Close both sockets; ``linger_ms``: how long queued frames may still go out (in
        the background: the shared context is never terminated, so nothing waits)."""
        if self.monitor is not None:
            with contextlib.suppress(zmq.ZMQError):
                self.sock.disable_monitor()
            self.monitor.close(linger=0)
        self.sock.close(linger=linger_ms)

"""The engine's ZMQ edges: where requests come in and outputs go out.

A client connects two DEALER sockets under one routing id (its client id): one to the
scheduler's ROUTER (requests, aborts, handshake, stats; errors come back on it), one to the
output processor's ROUTER (deltas). So no stage relays another stage's traffic.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import os

import msgspec
import zmq

from mpengine.addresses import listens_ipv6
from mpengine.protocol import (
    AddRequest,
    OutputBatch,
    RequestError,
    RequestHeader,
    describe_error,
    encoder,
)

logger = logging.getLogger(__name__)


class Sent(enum.Enum):
    OK = "ok"
    FULL = "full"  # the client's queue is at its high-water mark: it does not read
    GONE = "gone"  # no such client connected


# Replies (errors, stats, the tokenizer file) queued in ZMQ for one client on the request
# edge; more wait in the front door's backlog, bounded in bytes (``front.py``).
REPLY_HWM = 64
HANDSHAKE_MS = 5000


def bind_router(
    ctx: zmq.Context,
    address: str,
    max_msg_bytes: int,
    send_hwm: int = 0,
    auth_token: str | None = None,
) -> zmq.Socket:
    """A ROUTER for clients: messages over ``max_msg_bytes`` close the sender's connection
    before they are buffered (libzmq checks the size announced in the frame header), and at
    most ``send_hwm`` messages queue for one client (0: no bound)."""
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to a gone or full client raises
    sock.setsockopt(zmq.SNDHWM, send_hwm)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, max_msg_bytes)
    # A connection that has not finished its handshake (a tcp client without the token, or
    # none at all) is dropped after this, not libzmq's 30 s.
    sock.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_MS)
    if auth_token:
        from mpengine.auth import secure_server

        secure_server(sock, auth_token)
    if listens_ipv6(address):
        sock.setsockopt(zmq.IPV6, 1)
    sock.bind(address)
    if address.startswith("ipc://"):  # (libzmq makes it as the umask says)
        os.chmod(address[len("ipc://") :], 0o600)
    return sock


def remove_ipc_file(address: str) -> None:
    """libzmq leaves ``ipc://`` socket files behind."""
    if address.startswith("ipc://"):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(address[len("ipc://") :])


class Edge:
    """A bound ROUTER: receive ``(client_id, frame)`` pairs, send to a client by id.

    Frames up to ``max_frame_bytes`` are received; a larger one up to twice that gets an
    error reply (``error_for``), anything larger closes the sender's connection unread.
    """

    def __init__(
        self,
        address: str,
        max_frame_bytes: int,
        send_hwm: int = 0,
        auth_token: str | None = None,
    ) -> None:
        self.address = address
        self.max_frame_bytes = max_frame_bytes
        self.send_hwm = send_hwm
        self.ctx = zmq.Context(io_threads=1)
        self.sock = bind_router(self.ctx, address, 2 * max_frame_bytes, send_hwm, auth_token)
        self.poller = zmq.Poller()
        self.poller.register(self.sock, zmq.POLLIN)

    def receive(self, timeout_s: float) -> list[tuple[bytes, bytes]]:
        """Every frame waiting now, after waiting up to ``timeout_s`` for the first."""
        if not self.poller.poll(int(timeout_s * 1000)):
            return []
        frames = []
        while True:
            try:
                parts = self.sock.recv_multipart(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                return frames
            if len(parts) == 2:
                frames.append((parts[0], parts[1]))
            else:
                logger.warning("dropped a message of %d parts", len(parts))

    def send(self, client_id: bytes, payload: bytes) -> Sent:
        """Never blocks: a client that is gone or not reading is reported, not waited for."""
        try:
            self.sock.send_multipart((client_id, payload), zmq.NOBLOCK, copy=False)
            return Sent.OK
        except zmq.ZMQError as exc:
            if exc.errno == zmq.EAGAIN:
                return Sent.FULL
            if exc.errno == zmq.EHOSTUNREACH:
                return Sent.GONE
            raise

    def error_for(
        self, frame: bytes, exc: Exception | str, kind: str = "too_large"
    ) -> RequestError:
        """The answer to a request that could not be taken, naming it if its id can be
        read."""
        try:
            request_id = msgspec.msgpack.decode(frame, type=RequestHeader).request_id
        except (msgspec.DecodeError, msgspec.ValidationError):
            request_id = ""
        if isinstance(exc, str):
            message = exc
        else:
            message, kind = describe_error(exc, AddRequest), "invalid"
        logger.info("rejected request %r: %s", request_id, message)
        return RequestError(request_id, message, kind)

    def send_outputs(self, batches: dict[str, list]) -> dict[str, Sent]:
        """Send each client its deltas as one message; return the clients not reached."""
        failed = {}
        for client_id, deltas in batches.items():
            sent = self.send(client_id.encode(), encoder.encode(OutputBatch(deltas)))
            if sent is not Sent.OK:
                failed[client_id] = sent
        return failed

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()
        remove_ipc_file(self.address)

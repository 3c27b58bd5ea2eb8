"""The engine's ZMQ edges: where requests come in and outputs go out.

A client connects two DEALER sockets under one routing id (its client id): one to the
scheduler's ROUTER (requests, aborts, handshake, stats; errors come back on it), one to the
output processor's ROUTER (deltas). So no stage relays another stage's traffic.
"""

from __future__ import annotations

import contextlib
import logging
import os

import msgspec
import zmq

from mpengine.protocol import (
    AddRequest,
    OutputBatch,
    RequestError,
    RequestHeader,
    describe_error,
    encoder,
)

logger = logging.getLogger(__name__)


def bind_router(ctx: zmq.Context, address: str) -> zmq.Socket:
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to a gone client raises, not drops
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.bind(address)
    return sock


def remove_ipc_file(address: str) -> None:
    """libzmq leaves ``ipc://`` socket files behind."""
    if address.startswith("ipc://"):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(address[len("ipc://") :])


class Edge:
    """A bound ROUTER: receive ``(client_id, frame)`` pairs, send to a client by id."""

    def __init__(self, address: str, max_frame_bytes: int) -> None:
        self.address = address
        self.max_frame_bytes = max_frame_bytes
        self.ctx = zmq.Context(io_threads=1)
        self.sock = bind_router(self.ctx, address)
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

    def send(self, client_id: bytes, payload: bytes) -> bool:
        """False when the client is gone."""
        try:
            self.sock.send_multipart((client_id, payload), zmq.NOBLOCK, copy=False)
            return True
        except zmq.ZMQError as exc:
            if exc.errno in (zmq.EHOSTUNREACH, zmq.EAGAIN):
                return False
            raise

    def reply_error(
        self, client_id: bytes, frame: bytes, exc: Exception | str, kind: str = "too_large"
    ) -> None:
        """Answer a request that could not be taken; name it if its id can be read."""
        try:
            request_id = msgspec.msgpack.decode(frame, type=RequestHeader).request_id
        except (msgspec.DecodeError, msgspec.ValidationError):
            request_id = ""
        if isinstance(exc, str):
            message = exc
        else:
            message, kind = describe_error(exc, AddRequest), "invalid"
        logger.info("rejected request %r: %s", request_id, message)
        self.send(client_id, encoder.encode(RequestError(request_id, message, kind)))

    def send_outputs(self, batches: dict[str, list]) -> list[str]:
        """Send each client its deltas as one message; return the clients that are gone."""
        gone = []
        for client_id, deltas in batches.items():
            if not self.send(client_id.encode(), encoder.encode(OutputBatch(deltas))):
                gone.append(client_id)
        return gone

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()
        remove_ipc_file(self.address)

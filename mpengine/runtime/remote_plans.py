"""The plans' way to tensor-parallel ranks on other hosts: the broadcast's remote path.

Rank 0 binds an XPUB socket on ``master_addr:master_port + 1`` and sends every plan frame
on it; each rank of another node connects a SUB socket (CURVE with the engine's auth
token, as the client edges). XPUB hands rank 0 each subscription, so it starts serving
only once every remote rank is subscribed: no plan is sent before a rank can receive it
(PUB/SUB's "slow joiner"), and nothing is dropped after (no high-water mark). A remote rank
learns that rank 0 went away from its socket's monitor (a disconnection, or a heartbeat
that timed out for a host that vanished), rather than waiting for a plan forever.
"""

from __future__ import annotations

import logging
import time

import zmq
from zmq.utils.monitor import recv_monitor_message

from shm.broadcast import PeerGone

logger = logging.getLogger(__name__)

HEARTBEAT_MS = 1000  # ZMQ heartbeats: a silent peer is gone after HEARTBEAT_TIMEOUT_MS
HEARTBEAT_TIMEOUT_MS = 5000


def plan_address(host: str, master_port: int) -> str:
    return f"tcp://{host}:{master_port + 1}"


def _heartbeats(sock: zmq.Socket) -> None:
    sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_MS)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
    sock.setsockopt(zmq.LINGER, 0)


class PlanPublisher:
    """Rank 0's side: every plan frame to every remote rank."""

    def __init__(self, address: str, num_subscribers: int, token: str | None, timeout: float):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.XPUB)
        _heartbeats(self.sock)
        self.sock.setsockopt(zmq.SNDHWM, 0)
        self.sock.setsockopt(zmq.XPUB_VERBOSE, 1)  # every subscription, even a repeated one
        try:
            if token:
                from mpengine.auth import secure_server

                secure_server(self.sock, token)
            self.sock.bind(address)
            self._wait_subscribers(num_subscribers, timeout)
        except BaseException:
            self.close()
            raise
        logger.info("plans published on %s to %d remote ranks", address, num_subscribers)

    def _wait_subscribers(self, count: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        seen = 0
        while seen < count:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not self.sock.poll(remaining * 1000):
                raise TimeoutError(f"{seen} of the {count} remote ranks subscribed to the plans")
            if self.sock.recv()[:1] == b"\x01":
                seen += 1

    def put(self, frame: memoryview | bytes) -> None:
        self.sock.send(frame, copy=True)

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


class PlanSubscriber:
    """A remote rank's side: ``get(timeout)`` as a ring's; :class:`PeerGone` once rank 0
    went away."""

    def __init__(self, address: str, token: str | None) -> None:
        self.address = address
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        _heartbeats(self.sock)
        self.sock.setsockopt(zmq.RCVHWM, 0)
        if token:
            from mpengine.auth import secure_client

            secure_client(self.sock, token)
        self.monitor = self.sock.get_monitor_socket(
            zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED
        )
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.connect(address)
        self.connected = False
        self.poller = zmq.Poller()
        self.poller.register(self.sock, zmq.POLLIN)
        self.poller.register(self.monitor, zmq.POLLIN)

    def get(self, timeout: float) -> bytes:
        deadline = time.monotonic() + timeout
        while True:
            remaining = max(0.0, deadline - time.monotonic())
            events = dict(self.poller.poll(remaining * 1000))
            if self.sock in events:
                return self.sock.recv(copy=True)
            if self.monitor in events:
                self._event()
            elif time.monotonic() >= deadline:
                raise TimeoutError(f"no plan from {self.address}")

    def _event(self) -> None:
        event = recv_monitor_message(self.monitor)["event"]
        if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self.connected = True
        elif event == zmq.EVENT_DISCONNECTED and self.connected:
            raise PeerGone(f"rank 0 at {self.address} went away")

    def close(self) -> None:
        self.sock.disable_monitor()
        self.monitor.close(linger=0)
        self.sock.close(linger=0)
        self.ctx.term()

    def __enter__(self) -> PlanSubscriber:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

"""The scheduler's front door: client frames in, scheduler calls and replies out.

Shared by both runtimes. A bad frame or a rejected request gets a ``RequestError`` for that
request only; nothing a client sends can stop the loop.
"""

from __future__ import annotations

import logging

import msgspec

from mpengine.protocol import (
    Abort,
    AddRequest,
    EngineInfo,
    EngineStats,
    Hello,
    RequestError,
    StatsQuery,
    client_request_decoder,
    encoder,
)
from mpengine.runtime.edges import Edge
from mpengine.scheduler import RequestRejected, Scheduler

logger = logging.getLogger(__name__)


class FrontDoor:
    def __init__(self, edge: Edge, scheduler: Scheduler, info: EngineInfo) -> None:
        self.edge = edge
        self.scheduler = scheduler
        self.info = info
        self.decoder = client_request_decoder()

    def serve(self, timeout_s: float) -> int:
        """Handle every waiting client frame (waiting up to ``timeout_s`` for one)."""
        frames = self.edge.receive(timeout_s)
        for client_id, frame in frames:
            self.handle(client_id, frame)
        return len(frames)

    def handle(self, client_id: bytes, frame: bytes) -> None:
        if len(frame) > self.edge.max_frame_bytes:
            message = (
                f"request of {len(frame)} bytes exceeds max_request_bytes "
                f"({self.edge.max_frame_bytes})"
            )
            self.edge.reply_error(client_id, frame, message)
            return
        try:
            msg = self.decoder.decode(frame)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            self.edge.reply_error(client_id, frame, exc)
            return
        try:
            client = client_id.decode()
        except UnicodeDecodeError:
            # Outputs are routed by this id from the output processor: it must be text.
            message = "the client's routing id must be UTF-8 text (set zmq.ROUTING_ID)"
            self.edge.reply_error(client_id, frame, message, "invalid")
            return
        match msg:
            case AddRequest():
                try:
                    self.scheduler.add_request(msg, client)
                except RequestRejected as exc:
                    reply = RequestError(msg.request_id, str(exc), exc.kind)  # type: ignore[arg-type]
                    self.edge.send(client_id, encoder.encode(reply))
            case Abort():
                self.scheduler.abort(msg.request_ids)
            case Hello():
                self.edge.send(client_id, encoder.encode(self.info))
            case StatsQuery():
                reply = EngineStats(query_id=msg.query_id, **self.scheduler.stats())
                self.edge.send(client_id, encoder.encode(reply))

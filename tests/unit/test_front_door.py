"""The request edge's front door keeps the replies a client has not read yet: in order,
bounded in bytes, forgotten when the client reads none of them for a while."""

from __future__ import annotations

import msgspec
import pytest

from mpengine.protocol import RequestError
from mpengine.runtime import front
from mpengine.runtime.edges import Sent
from mpengine.runtime.front import FrontDoor


class SlowEdge:
    """Takes ``room`` messages, then reports the client's queue full until given more."""

    max_frame_bytes = 1 << 20

    def __init__(self, room: int) -> None:
        self.room = room
        self.delivered: list[str] = []

    def receive(self, timeout_s: float) -> list:
        return []

    def send(self, client_id: bytes, payload: bytes) -> Sent:
        if self.room == 0:
            return Sent.FULL
        self.room -= 1
        self.delivered.append(msgspec.msgpack.decode(payload)[1])
        return Sent.OK


def refuse(door: FrontDoor, count: int) -> None:
    for i in range(count):
        door._reply(b"c", RequestError(f"r{i}", "overloaded", "overloaded"))


def test_replies_wait_for_a_slow_reader_in_order() -> None:
    edge = SlowEdge(room=3)
    door = FrontDoor(edge, None, None)  # type: ignore[arg-type]
    refuse(door, 10)
    assert edge.delivered == ["r0", "r1", "r2"]
    door.serve(0.0)  # nothing read meanwhile: nothing more goes
    edge.room = 4
    door.serve(0.0)
    edge.room = 100
    door.serve(0.0)
    assert edge.delivered == [f"r{i}" for i in range(10)]
    assert not door._backlog  # all sent: nothing kept, no more polling


def test_a_client_that_never_reads_is_bounded_and_forgotten(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    edge = SlowEdge(room=0)
    door = FrontDoor(edge, None, None)  # type: ignore[arg-type]
    monkeypatch.setattr(front, "MAX_PENDING_REPLY_BYTES", 200)
    with caplog.at_level("WARNING", logger="mpengine.runtime.front"):
        refuse(door, 50)
    kept = len(door._backlog[b"c"].replies)
    assert 0 < kept < 50 and door._backlog[b"c"].size <= 200
    assert caplog.text.count("dropping replies") == 1  # one line for the flood
    monkeypatch.setattr(front, "BACKLOG_STALL_S", -1.0)  # (read none for "long enough")
    with caplog.at_level("WARNING", logger="mpengine.runtime.front"):
        door.serve(0.0)
    assert f"dropped {kept} replies" in caplog.text
    assert not door._backlog

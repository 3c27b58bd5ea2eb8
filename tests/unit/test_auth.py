"""CURVE keys derived from one token; the ZAP handler accepts only that token's clients and
never keeps a context from terminating."""

from __future__ import annotations

import contextlib
import hashlib
import threading

import pytest
import zmq
from zmq.utils import z85

from mpengine.runtime import auth

pytestmark = pytest.mark.skipif(not zmq.has("curve"), reason="libzmq without CURVE")


def test_keys_derive_from_the_token():
    digest = hashlib.sha256(b"mpengine-curve-server\0s3cret").digest()
    assert auth.server_secret_key("s3cret") == z85.encode(digest[:32])
    digest = hashlib.sha256(b"mpengine-curve-client\0s3cret").digest()
    assert auth.client_secret_key("s3cret") == z85.encode(digest[:32])
    assert auth.server_public_key("s3cret") == zmq.curve_public(auth.server_secret_key("s3cret"))
    assert auth.client_public_key("s3cret") == zmq.curve_public(auth.client_secret_key("s3cret"))
    assert len(auth.server_public_key("s3cret")) == 40
    assert auth.server_secret_key("s3cret") != auth.client_secret_key("s3cret")
    assert auth.server_public_key("s3cret") != auth.server_public_key("other")
    with pytest.raises(ValueError):
        auth.server_secret_key("")


def connect(ctx: zmq.Context, port: int, token: str | None) -> tuple[zmq.Socket, zmq.Socket]:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if token is not None:
        auth.secure_client(sock, token)
    monitor = sock.get_monitor_socket(
        zmq.EVENT_HANDSHAKE_SUCCEEDED
        | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
        | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
        | zmq.EVENT_HANDSHAKE_FAILED_AUTH
    )
    sock.connect(f"tcp://127.0.0.1:{port}")
    return sock, monitor


def first_event(monitor: zmq.Socket) -> int:
    from zmq.utils.monitor import recv_monitor_message

    assert monitor.poll(5000), "no handshake event"
    return recv_monitor_message(monitor)["event"]


def test_only_the_token_gets_through_and_the_context_still_terminates():
    server_ctx, client_ctx = zmq.Context(), zmq.Context()
    try:
        router = server_ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        auth.secure_server(router, "s3cret")
        port = router.bind_to_random_port("tcp://127.0.0.1")

        good, monitor = connect(client_ctx, port, "s3cret")
        assert first_event(monitor) == zmq.EVENT_HANDSHAKE_SUCCEEDED
        good.send(b"hello")
        assert router.poll(5000)
        assert router.recv_multipart()[1] == b"hello"

        for token in ("wrong", None):
            bad, monitor = connect(client_ctx, port, token)
            assert first_event(monitor) != zmq.EVENT_HANDSHAKE_SUCCEEDED
            # Refused, the socket may hold no connection at all: a blocking send would wait
            # for one forever.
            with contextlib.suppress(zmq.Again):
                bad.send(b"let me in", zmq.NOBLOCK)
        assert not router.poll(300), "nothing from a client without the token"
    finally:
        client_ctx.destroy(linger=0)
        router.close(linger=0)
        # The ZAP handler thread closes its socket on ETERM: term() must not wait for it.
        terminator = threading.Thread(target=server_ctx.term, daemon=True)
        terminator.start()
        terminator.join(5)
    assert not terminator.is_alive(), "ctx.term() hung on the ZAP handler"

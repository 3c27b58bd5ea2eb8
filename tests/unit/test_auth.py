"""CURVE keys derived from one token; the ZAP handler accepts only that token's clients and
never keeps a context from terminating."""

from __future__ import annotations

import contextlib
import hashlib
import threading

import pytest
import zmq
from zmq.utils import z85

from mpengine import auth

pytestmark = pytest.mark.skipif(not zmq.has("curve"), reason="libzmq without CURVE")


def test_keys_derive_from_the_token():
    """By scrypt: a fast hash let one recorded connection test ~11,000 guesses a second."""
    keys = hashlib.scrypt(b"s3cret", salt=auth.KDF_SALT, n=2**14, r=8, p=1, dklen=64)
    assert auth.server_secret_key("s3cret") == z85.encode(keys[:32])
    assert auth.client_secret_key("s3cret") == z85.encode(keys[32:])
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


def test_the_command_line_reads_the_token_from_a_file_or_the_environment(tmp_path, monkeypatch):
    """A token on the command line is in every user's process list: a file or the
    environment keep it out."""
    from mpengine.cli import build_parser, config_from_args
    from mpengine.envs import auth_token

    monkeypatch.delenv("MPENGINE_AUTH_TOKEN", raising=False)
    (tmp_path / "token").write_text("s3cret\n")
    (tmp_path / "empty").write_text("\n")
    assert auth_token(None, str(tmp_path / "token")) == "s3cret"
    assert auth_token("given", None) == "given"
    assert auth_token(None, None) is None
    monkeypatch.setenv("MPENGINE_AUTH_TOKEN", "from-env")
    assert auth_token(None, None) == "from-env"
    assert auth_token(None, str(tmp_path / "token")) == "s3cret"
    for token, path, message in [
        ("x", str(tmp_path / "token"), "not both"),
        (None, str(tmp_path / "empty"), "holds no token"),
        (None, str(tmp_path / "missing"), "cannot read"),
    ]:
        with pytest.raises(ValueError, match=message):
            auth_token(token, path)
    args = build_parser().parse_args(
        ["serve", "--address", "tcp://127.0.0.1:5555", "--auth-token-file", str(tmp_path / "token")]
    )
    assert config_from_args(args).auth_token == "s3cret"
    args = build_parser().parse_args(["serve", "--address", "tcp://127.0.0.1:5555"])
    assert config_from_args(args).auth_token == "from-env"

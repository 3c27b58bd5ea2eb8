"""Authentication of clients: ZMQ CURVE keys derived from one shared token.

Users handle one secret, the engine's ``auth_token``. Both key pairs derive from it, by
scrypt (about 50 ms and 16 MiB per process, once): one recorded connection lets anyone try
guesses of the token offline, and a fast hash let a Python loop try ~11,000 a second.

    server secret, client secret = scrypt(token, salt, n=2**14, r=8, p=1)[:32], [32:64]
                                   (z85 for pyzmq)
    public keys                  = zmq.curve_public(secret)

The engine's ROUTER sockets are CURVE servers (``secure_server``) and accept only the derived
client public key; a client (``secure_client``) must know the token to derive both the server
key it encrypts to and the client key it is accepted by. Once connected the traffic is
encrypted too.

The ZAP handler that checks client keys is one thread per context and process, bound to
``inproc://zeromq.zap.01`` of the socket's context. It closes its socket as soon as the
context is terminated, so ``ctx.term()`` never waits for it. (pyzmq's ``ThreadAuthenticator``
would keep its socket open until ``stop()``, so a context with one could not be terminated
without extra bookkeeping.)
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import threading
import weakref

import zmq
from zmq.utils import z85

logger = logging.getLogger(__name__)

ZAP_ENDPOINT = "inproc://zeromq.zap.01"
KDF_SALT = b"mpengine-curve-keys"
_DOMAIN_PREFIX = "mpengine."


class AuthUnavailableError(RuntimeError):
    """This libzmq was built without CURVE (libsodium): tokens cannot be used."""


def require_curve() -> None:
    if not zmq.has("curve"):
        raise AuthUnavailableError(
            f"auth_token needs ZMQ CURVE security, but libzmq {zmq.zmq_version()} was built "
            "without it (install a pyzmq wheel, which bundles libsodium)"
        )


@functools.lru_cache(maxsize=4)
def _secrets(token: str) -> bytes:
    if not token:
        raise ValueError("the auth token must not be empty")
    return hashlib.scrypt(token.encode(), salt=KDF_SALT, n=2**14, r=8, p=1, dklen=64)


def _secret(role: str, token: str) -> bytes:
    keys = _secrets(token)
    return z85.encode(keys[:32] if role == "server" else keys[32:])


def server_secret_key(token: str) -> bytes:
    """The engine's CURVE secret key (z85, 40 bytes)."""
    return _secret("server", token)


def client_secret_key(token: str) -> bytes:
    """The clients' CURVE secret key (z85, 40 bytes)."""
    return _secret("client", token)


def server_public_key(token: str) -> bytes:
    require_curve()
    return zmq.curve_public(server_secret_key(token))


def client_public_key(token: str) -> bytes:
    require_curve()
    return zmq.curve_public(client_secret_key(token))


def secure_server(sock: zmq.Socket, token: str) -> None:
    """Make ``sock`` (before it binds) a CURVE server accepting only clients with ``token``."""
    require_curve()
    client_key = z85.decode(client_public_key(token))
    domain = _DOMAIN_PREFIX + hashlib.sha256(client_key).hexdigest()[:16]
    _zap_handler(sock.context).allow(domain, client_key)
    sock.setsockopt(zmq.ZAP_DOMAIN, domain.encode())
    sock.setsockopt(zmq.CURVE_SERVER, 1)
    sock.setsockopt(zmq.CURVE_SECRETKEY, server_secret_key(token))


def secure_client(sock: zmq.Socket, token: str) -> None:
    """Make ``sock`` (before it connects) a CURVE client presenting ``token``."""
    require_curve()
    sock.setsockopt(zmq.CURVE_SERVERKEY, server_public_key(token))
    sock.setsockopt(zmq.CURVE_PUBLICKEY, client_public_key(token))
    sock.setsockopt(zmq.CURVE_SECRETKEY, client_secret_key(token))


# -- the ZAP handler -------------------------------------------------------------------------


class _ZapHandler:
    """Answers libzmq's ZAP requests (RFC 27) for one context: CURVE clients whose public
    key is allowed for the socket's domain get 200, everything else 400."""

    def __init__(self, ctx: zmq.Context) -> None:
        self.allowed: dict[bytes, set[bytes]] = {}
        sock = ctx.socket(zmq.REP)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.bind(ZAP_ENDPOINT)
        except zmq.ZMQError as exc:
            sock.close(linger=0)
            raise RuntimeError(
                f"cannot bind the ZAP handler ({exc}): another authenticator uses this context"
            ) from exc
        # Only the thread holds the socket (and through it the context): a terminated
        # context is not kept alive by its finished handler.
        self.thread = threading.Thread(
            target=self._run, args=(sock,), name="mpengine-zap", daemon=True
        )
        self.thread.start()

    def allow(self, domain: str, client_key: bytes) -> None:
        self.allowed.setdefault(domain.encode(), set()).add(client_key)

    def _run(self, sock: zmq.Socket) -> None:
        try:
            while True:
                try:
                    request = sock.recv_multipart()
                except zmq.ContextTerminated:
                    return
                sock.send_multipart(self._reply(request))
        except zmq.ZMQError as exc:  # the context was destroyed under us
            logger.debug("ZAP handler stops: %s", exc)
        except Exception:
            logger.exception("the ZAP handler failed: every new client will be refused")
        finally:
            sock.close(linger=0)

    def _reply(self, request: list[bytes]) -> list[bytes]:
        # version, request id, domain, address, routing id, mechanism, credentials...
        if len(request) < 6:
            return [b"1.0", b"", b"500", b"malformed ZAP request", b"", b""]
        version, request_id, domain, address, _, mechanism, *credentials = request
        ok = (
            mechanism == b"CURVE"
            and len(credentials) == 1
            and credentials[0] in self.allowed.get(domain, ())
        )
        if not ok:
            logger.warning(
                "refused a client from %s: wrong auth token", address.decode("ascii", "replace")
            )
            return [version, request_id, b"400", b"wrong auth token", b"", b""]
        return [version, request_id, b"200", b"OK", b"client", b""]


_handlers: weakref.WeakKeyDictionary[zmq.Context, _ZapHandler] = weakref.WeakKeyDictionary()
_handlers_pid = os.getpid()
_handlers_lock = threading.Lock()


def _zap_handler(ctx: zmq.Context) -> _ZapHandler:
    global _handlers, _handlers_pid
    with _handlers_lock:
        if _handlers_pid != os.getpid():  # forked: the parent's threads are not here
            _handlers, _handlers_pid = weakref.WeakKeyDictionary(), os.getpid()
        handler = _handlers.get(ctx)
        if handler is None or not handler.thread.is_alive():
            handler = _handlers[ctx] = _ZapHandler(ctx)
        return handler

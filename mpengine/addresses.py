"""Engine addresses: ``ipc://DIR`` (a private directory) or ``tcp://HOST:PORT`` (requests on
PORT, outputs on PORT+1). An IPv6 host is written in brackets (``tcp://[::1]:5555``)."""

from __future__ import annotations

import os
import socket

# Hosts that bind every interface; a client reaches them at a host of its own choosing.
WILDCARD_HOSTS = {"", "*", "0.0.0.0", "[::]", "::", "[*]"}
MAX_PORT = 65534  # the output socket listens on PORT+1


def split_tcp(address: str) -> tuple[str, str] | None:
    """``tcp://HOST:PORT`` as ``(HOST, PORT)`` (IPv6 hosts keep their brackets); None for
    any other scheme."""
    if not address.startswith("tcp://"):
        return None
    host, _, port = address[len("tcp://") :].rpartition(":")
    return host, port


def check_engine_address(address: str) -> None:
    """Raise ``ValueError`` (one line, naming what is wrong) unless ``address`` is one an
    engine can listen at."""
    usage = "address must be ipc://DIR or tcp://HOST:PORT"
    if address.startswith("ipc://"):
        if not address[len("ipc://") :]:
            raise ValueError(f"{usage}: ipc:// names no directory")
        return
    parts = split_tcp(address)
    if parts is None:
        raise ValueError(f"{usage}, got {address!r}")
    host, port = parts
    if not host or not port.isdigit():
        raise ValueError(f"{usage} (an IPv6 host in brackets), got {address!r}")
    if not 1 <= int(port) <= MAX_PORT:
        raise ValueError(
            f"address: port {int(port)} is out of range: requests listen on PORT and outputs "
            f"on PORT+1, so PORT must be 1..{MAX_PORT}"
        )
    if ":" in host and not host.startswith("["):
        raise ValueError(f"address: write an IPv6 host in brackets, tcp://[{host}]:{port}")


def listens_ipv6(address: str) -> bool:
    """Whether a socket binding ``address`` needs IPv6 on: a bracketed host, or the ``*``
    wildcard (every interface, IPv6 ones too; libzmq falls back to IPv4 without IPv6)."""
    parts = split_tcp(address)
    return parts is not None and (parts[0].startswith("[") or parts[0] == "*")


def connectable(address: str) -> str:
    """An address a client can connect to: a wildcard tcp host (an engine's bind address,
    ``tcp://*:5555``) means this host; ``ipc://DIR``, the directory an engine was given as
    its address, means its request socket ``ipc://DIR/requests.sock``."""
    if not address.startswith(("ipc://", "tcp://")):
        raise ValueError(
            f"{address!r} is not an engine address: ipc://PATH (a socket or the engine's "
            "directory) or tcp://HOST:PORT"
        )
    if address.startswith("ipc://") and os.path.isdir(address[len("ipc://") :]):
        return address.rstrip("/") + "/requests.sock"
    parts = split_tcp(address)
    if parts is None or parts[0] not in WILDCARD_HOSTS:
        return address
    loopback = "[::1]" if parts[0].startswith("[") or parts[0] == "::" else "127.0.0.1"
    return f"tcp://{loopback}:{parts[1]}"


def output_address(request_address: str, advertised: str) -> str:
    """Where a client connects for outputs: the engine's advertised output address, except
    that a wildcard host (the engine binds every interface, ``tcp://*:5556``) becomes the
    host the client reached the engine at for requests."""
    out = split_tcp(advertised)
    if out is None or out[0] not in WILDCARD_HOSTS:
        return advertised
    request = split_tcp(request_address)
    return connectable(advertised) if request is None else f"tcp://{request[0]}:{out[1]}"


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (the kernel's pick; free until someone binds it)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]

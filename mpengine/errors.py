"""The exceptions mpengine raises to its users, below both the launcher and the client
library (so a client that only connects never imports the launcher)."""

from __future__ import annotations


class EngineStartError(RuntimeError):
    """The engine could not start: a stage failed, or its address is unsafe or in use."""


class EngineDeadError(RuntimeError):
    """The engine stopped while requests were in flight."""


class InvalidRequestError(ValueError):
    """The engine rejected a request (bad prompt or parameters, overloaded...); it keeps
    serving the others. ``kind`` is the engine's reason (``RequestError.kind``)."""

    def __init__(self, message: str, kind: str = "invalid") -> None:
        super().__init__(message)
        self.kind = kind


class RequestFailedError(RuntimeError):
    """An embedding request ended without its embedding (its step failed, or it was
    aborted); the message says why."""


class ClientClosedError(RuntimeError):
    """The client was closed (or dropped) while the request was pending, or used after."""


class ProtocolError(RuntimeError):
    """A frame from the engine could not be decoded (client and engine versions differ?)."""

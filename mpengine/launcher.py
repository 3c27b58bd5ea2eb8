"""What every launcher gives its caller (``launch.Engine``, ``data_parallel``'s replica
sets): clients of its engine, made by its ``_make_client``, unless the engine is gone."""

from __future__ import annotations

import threading
from typing import TypeVar

from mpengine.client.async_client import AsyncClient
from mpengine.client.sync_client import Client
from mpengine.config import EngineConfig
from mpengine.errors import EngineDeadError

C = TypeVar("C", Client, AsyncClient)


class Launcher:
    """What every launcher gives its caller: clients of its engine, told at once when a
    stage dies (``_make_client``), unless the engine is gone."""

    config: EngineConfig
    dead: str | None
    _stopping: threading.Event

    def client(
        self, *, timeout: float = 30.0, client_id: str | None = None, auth_token: str | None = None
    ) -> Client:
        """A ``Client`` of this engine (with its auth token unless given another); told at
        once if a stage dies."""
        return self._connect(Client, timeout, client_id, auth_token)

    def async_client(
        self, *, timeout: float = 30.0, client_id: str | None = None, auth_token: str | None = None
    ) -> AsyncClient:
        """An ``AsyncClient`` of this engine, as ``client``."""
        return self._connect(AsyncClient, timeout, client_id, auth_token)

    def _connect(
        self, kind: type[C], timeout: float, client_id: str | None, auth_token: str | None
    ) -> C:
        if self.dead is not None:
            raise EngineDeadError(f"the engine is dead: {self.dead}")
        if self._stopping.is_set():
            raise EngineDeadError("the engine was shut down")
        token = auth_token if auth_token is not None else self.config.auth_token
        return self._make_client(kind, timeout, client_id, token)

    def _make_client(
        self, kind: type[C], timeout: float, client_id: str | None, token: str | None
    ) -> C:
        raise NotImplementedError

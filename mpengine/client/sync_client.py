"""``Client``: the blocking client, the calls of ``Calls`` blocking on each wait."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from mpengine.client.calls import Calls
from mpengine.client.requests import Batch
from mpengine.client.waits import Blocking, Inbox, Wait, blocking


class Client(Calls, Blocking, waits=blocking):
    """Blocking client. Thread-safe: many threads may generate at once.

    ``address``: the engine's request address (``engine.address``; ``ipc://...`` or
    ``tcp://host:port``), or those of its data-parallel replicas (a list, or one string
    separated by commas): each request goes to one of them, by ``routing``
    (``least_outstanding`` or ``prefix_affinity``, ``client/routing.py``) or as a call's
    ``data_parallel_rank`` pins it. ``timeout``: seconds for the handshake (and tokenizer fetch).
    ``client_id``: a name for the client in logs (default: random); each connection routes
    under it plus a nonce of its own, so clients may share a name.
    ``auth_token``: the engine's ``auth_token``, if it has one.
    """

    _inbox = Inbox

    def _prepare(
        self, texts: Sequence[object], work: Callable[[], Any], tokenizer: bool = False
    ) -> Wait:
        return work  # here and now: this client blocks anyway

    def _made(self, batch: Batch) -> Wait:
        return batch.made  # each request made (its text tokenized) as the window admits it

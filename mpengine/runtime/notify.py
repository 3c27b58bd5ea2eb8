"""sd_notify: tell systemd (or whatever listens on ``NOTIFY_SOCKET``) how the service is.

The protocol is one unix datagram per message, ``KEY=VALUE`` lines, to the path in
``NOTIFY_SOCKET`` (a leading ``@`` means the abstract namespace). ``READY=1`` once serving,
``WATCHDOG=1`` at least every ``WATCHDOG_USEC / 2`` while healthy, ``STATUS=...`` for
``systemctl status``, ``STOPPING=1`` when shutting down. Without ``NOTIFY_SOCKET`` every
call does nothing. A failed send is logged once, never raised: the service keeps serving.
"""

from __future__ import annotations

import logging
import os
import socket

logger = logging.getLogger(__name__)


class Notifier:
    def __init__(self, address: str | None = None, watchdog_usec: str | None = None) -> None:
        self.address = address
        self._socket: socket.socket | None = None
        self._warned = False
        self.watchdog_interval: float | None = None  # seconds between pings, when asked for
        if watchdog_usec and watchdog_usec.isdigit() and int(watchdog_usec) > 0:
            self.watchdog_interval = int(watchdog_usec) / 2e6

    @classmethod
    def from_environment(cls) -> Notifier:
        """As systemd configures the main process: ``NOTIFY_SOCKET``, ``WATCHDOG_USEC`` (for
        this process only if ``WATCHDOG_PID``, when set, is its pid)."""
        watchdog = os.environ.get("WATCHDOG_USEC")
        owner = os.environ.get("WATCHDOG_PID")
        if owner and owner != str(os.getpid()):
            watchdog = None
        return cls(os.environ.get("NOTIFY_SOCKET") or None, watchdog)

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def notify(self, **fields: str) -> None:
        """Send ``KEY=VALUE`` lines (``notify(READY="1", STATUS="...")``)."""
        if self.address is None:
            return
        message = "\n".join(f"{key}={value}" for key, value in fields.items())
        target = "\0" + self.address[1:] if self.address.startswith("@") else self.address
        try:
            if self._socket is None:
                self._socket = socket.socket(
                    socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC
                )
            self._socket.sendto(message.encode(), target)
        except OSError as exc:
            if not self._warned:
                logger.warning("cannot notify %s: %s", self.address, exc)
                self._warned = True

    def ready(self, status: str) -> None:
        self.notify(READY="1", STATUS=_one_line(status))

    def status(self, status: str) -> None:
        self.notify(STATUS=_one_line(status))

    def watchdog(self) -> None:
        self.notify(WATCHDOG="1")

    def stopping(self, status: str) -> None:
        self.notify(STOPPING="1", STATUS=_one_line(status))

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close()
            self._socket = None


def _one_line(text: str) -> str:
    return " ".join(text.split())

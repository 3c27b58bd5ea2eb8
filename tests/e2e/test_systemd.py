"""The systemd service: the unit file verifies, and ``mpengine serve`` speaks sd_notify to a
real unix datagram socket standing in for systemd's ``NOTIFY_SOCKET``: ``READY=1``,
``STATUS=``, ``WATCHDOG=1`` only while the pipeline is healthy (a SIGSTOPped executor
stops the pings), ``STOPPING=1`` when told to stop."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

import mpengine
from mpengine import SamplingParams
from mpengine.runtime.engine_file import find_engine
from mpengine.runtime.notify import Notifier
from tests.e2e.test_server_cli import start

UNIT = Path(__file__).resolve().parents[2] / "tools" / "systemd" / "mpengine.service"
WAIT_S = 30.0


def test_unit_file_verifies(tmp_path: Path) -> None:
    unit = UNIT.read_text()
    for setting in (
        "Type=notify",
        "Restart=on-failure",
        "KillMode=mixed",
        "NoNewPrivileges=yes",
        "ProtectSystem=strict",
        "PrivateTmp=yes",
        "ProtectHome=yes",
        "DynamicUser=yes",
        "RuntimeDirectory=mpengine",
    ):
        assert re.search(rf"^{setting}$", unit, re.M), setting
    assert re.search(r"^ExecStart=\S+/mpengine serve ", unit, re.M)
    assert int(re.search(r"^WatchdogSec=(\d+)$", unit, re.M).group(1)) > 0
    drain = float(re.search(r"--drain-timeout (\d+)", unit).group(1))
    assert int(re.search(r"^TimeoutStopSec=(\d+)$", unit, re.M).group(1)) > drain
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed")
    # verify checks that ExecStart's program exists: point it at this environment's.
    program = Path(sys.executable).with_name("mpengine")
    if not program.exists():
        program = Path(shutil.which("true") or "/bin/true")
    path = tmp_path / "mpengine.service"
    path.write_text(unit.replace("/opt/mpengine/bin/mpengine", str(program)))
    done = subprocess.run(
        [analyze, "verify", str(path)], capture_output=True, text=True, timeout=60
    )
    if done.returncode != 0 and "mpengine.service" not in done.stderr:
        pytest.skip(f"systemd-analyze cannot run here: {done.stderr.strip()}")
    assert done.returncode == 0 and "mpengine.service" not in done.stderr, done.stderr


def test_notifier_speaks_the_protocol(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with _listener(str(tmp_path / "notify.sock")) as messages:
        notifier = Notifier(str(tmp_path / "notify.sock"), "2000000")
        assert notifier.watchdog_interval == 1.0
        notifier.ready("tiny:\nserving")
        notifier.watchdog()
        assert messages.next() == {"READY": "1", "STATUS": "tiny: serving"}
        assert messages.next() == {"WATCHDOG": "1"}
    abstract = f"@mpengine-test-{os.getpid()}"
    with _listener("\0" + abstract[1:]) as messages:
        Notifier(abstract).stopping("bye")
        assert messages.next() == {"STOPPING": "1", "STATUS": "bye"}
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "gone.sock"))
    monkeypatch.setenv("WATCHDOG_USEC", "1000000")
    monkeypatch.setenv("WATCHDOG_PID", "1")  # the watchdog is another process's
    notifier = Notifier.from_environment()
    assert notifier.enabled and notifier.watchdog_interval is None
    notifier.ready("nobody listens")  # logged, never raised


class _Messages:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    def next(self, timeout: float = WAIT_S) -> dict[str, str]:
        self.sock.settimeout(timeout)
        data = self.sock.recv(65536).decode()
        return dict(line.split("=", 1) for line in data.splitlines() if "=" in line)

    def wait_for(self, predicate, timeout: float = WAIT_S) -> dict[str, str]:
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            assert remaining > 0, "the awaited notification never came"
            try:
                message = self.next(remaining)
            except TimeoutError:
                continue
            if predicate(message):
                return message

    def during(self, seconds: float) -> list[dict[str, str]]:
        """Every message of the next ``seconds``."""
        deadline = time.monotonic() + seconds
        messages = []
        while (remaining := deadline - time.monotonic()) > 0:
            try:
                messages.append(self.next(remaining))
            except TimeoutError:
                break
        return messages


class _listener:
    def __init__(self, address: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(address)

    def __enter__(self) -> _Messages:
        return _Messages(self.sock)

    def __exit__(self, *exc: object) -> None:
        self.sock.close()


def _health(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url + "/health", timeout=10) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def test_ready_watchdog_stall_and_stop(tmp_path: Path) -> None:
    notify = str(tmp_path / "notify.sock")
    with _listener(notify) as messages:
        env = {"NOTIFY_SOCKET": notify, "WATCHDOG_USEC": "1000000"}  # a ping every 0.5 s
        served = start(tmp_path / "srv", "--stall-timeout", "1", "--drain-timeout", "2", env=env)
        try:
            ready = messages.wait_for(lambda m: m.get("READY") == "1")
            assert "serving" in ready["STATUS"] and "0 running" in ready["STATUS"]
            messages.wait_for(lambda m: m.get("WATCHDOG") == "1")

            # A request that runs for long, then its executor stops: a stall.
            client = mpengine.Client(served.address)
            results: list[object] = []
            long = SamplingParams(max_tokens=4000, ignore_eos=True)
            worker = threading.Thread(
                target=lambda: results.append(client.generate("go", long, timeout=120))
            )
            worker.start()
            deadline = time.monotonic() + WAIT_S
            while client.stats().num_running == 0:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            executor = find_engine(served.address).stages["executor"]
            os.kill(executor, signal.SIGSTOP)
            try:
                stalled = messages.wait_for(lambda m: "stalled" in m.get("STATUS", ""))
                assert "1 running" in stalled["STATUS"]
                quiet = messages.during(2.0)  # four ping intervals
                assert not [m for m in quiet if "WATCHDOG" in m], quiet
                status, body = _health(served.url)
                assert status == 503 and "stalled" in body
            finally:
                os.kill(executor, signal.SIGCONT)
            messages.wait_for(lambda m: m.get("WATCHDOG") == "1")
            assert _health(served.url)[0] == 200

            # SIGINT drains too: the long request is aborted at the deadline.
            served.proc.send_signal(signal.SIGINT)
            stopping = messages.wait_for(lambda m: m.get("STOPPING") == "1")
            assert "draining" in stopping["STATUS"]
            assert served.proc.wait(WAIT_S) == 0, served.log()
            worker.join(WAIT_S)
            assert [r.finish_reason for r in results] == ["abort"]
            client.close()
        finally:
            if served.proc.poll() is None:
                served.stop(signal.SIGKILL)

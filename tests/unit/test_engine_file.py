"""Finding a running engine: by the URL of `mpengine serve` on this host, through the engine
file in its runtime directory."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

import pytest

from mpengine.cli import main
from mpengine.runtime.engine_file import address_of_url, write_engine_file


@pytest.fixture
def temp_dir(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path


def runtime_dir(root, name: str, record: dict) -> str:
    directory = root / f"mpengine-{name}-1-2-x"
    directory.mkdir()
    write_engine_file(str(directory), record)
    return str(directory)


def test_the_url_of_a_live_server_names_its_engine(temp_dir) -> None:
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True
    )
    dead_pid = int(gone.stdout)  # (exited: its pid names no process now, or another one)
    runtime_dir(temp_dir, "a", {"pid": dead_pid, "http": "http://127.0.0.1:8123"})
    live = runtime_dir(temp_dir, "b", {"pid": os.getpid(), "http": "http://127.0.0.1:8123"})
    runtime_dir(temp_dir, "c", {"pid": os.getpid(), "http": "http://127.0.0.1:9000"})
    runtime_dir(temp_dir, "d", {"pid": os.getpid()})  # no HTTP front
    assert address_of_url("http://localhost:8123") == f"ipc://{live}"
    assert address_of_url("http://127.0.0.1:9000/v1") == f"ipc://{temp_dir}/mpengine-c-1-2-x"
    with pytest.raises(LookupError, match=r"no engine of this host serves http://127\.0\.0\.1:7"):
        address_of_url("http://127.0.0.1:7")


def test_stats_of_a_url_nobody_serves_fails_in_one_line(temp_dir) -> None:
    with pytest.raises(SystemExit) as refused:
        main(["stats", "http://127.0.0.1:7"])
    assert "no engine of this host serves http://127.0.0.1:7" in str(refused.value.code)
    assert "ipc://" in str(refused.value.code)

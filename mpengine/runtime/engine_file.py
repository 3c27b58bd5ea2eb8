"""Finding a running engine's processes: the engine file and ``/proc``.

The launcher writes ``engine.json`` beside the ipc sockets (``ipc://DIR`` -> ``DIR``): its
own pid, the runtime directory and each stage's pid (``mpengine serve`` adds its HTTP
address). ``mpengine stacks`` and ``mpengine top`` start from there, or from a pid.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path

from mpengine.envs import write_atomically
from shm.segment import pid_alive

ENGINE_FILE = "engine.json"
# A launcher's runtime directory in the temp dir: mpengine-<engine id>-<pid>-<pid ns>-<random>.
RUNTIME_DIR_GLOB = "mpengine-*-*-*-*"
REPLICA_DIR_GLOB = "mpengine-*-dp-*/dp*"  # a data-parallel engine's replicas (data_parallel.py)


def write_engine_file(directory: str, record: dict) -> None:
    """Write ``DIR/engine.json`` (0600): aside, then renamed, so that a reader never sees
    half a file."""
    write_atomically(Path(directory) / ENGINE_FILE, json.dumps(record).encode(), mode=0o600)


def read_engine_file(directory: str) -> dict | None:
    try:
        return json.loads((Path(directory) / ENGINE_FILE).read_text())
    except (OSError, ValueError):
        return None


@dataclass(slots=True)
class EngineProcesses:
    """A running engine's processes: the launcher (``mpengine serve``...) and its stages."""

    launcher_pid: int
    runtime_dir: str | None
    stages: dict[str, int]  # stage name -> pid
    http: str | None = None  # the HTTP front end's base URL, when it has one
    extra: dict = field(default_factory=dict)


def address_of_url(url: str) -> str:
    """The ipc address of the engine that ``mpengine serve`` on this host serves at ``url``
    (``http[s]://HOST:PORT``): the engine file of a runtime directory in the temp dir names
    it (a port is one server's on a host). LookupError when no live engine there does."""
    port = urllib.parse.urlsplit(url).port
    found = []  # (of data-parallel replicas: every one's, in order)
    for pattern in (RUNTIME_DIR_GLOB, REPLICA_DIR_GLOB):
        for path in sorted(Path(tempfile.gettempdir()).glob(f"{pattern}/{ENGINE_FILE}")):
            record = read_engine_file(str(path.parent)) or {}
            http = record.get("http")
            pid = record.get("pid")
            ours = http and urllib.parse.urlsplit(http).port == port
            if ours and _is_pid(pid) and pid_alive(pid):
                found.append(f"ipc://{path.parent}")
    if found:
        return ",".join(sorted(found, key=lambda a: (len(a), a)))
    raise LookupError(
        f"no engine of this host serves {url} from the temp dir; give its ipc:// address "
        "(`mpengine serve` prints it at start)"
    )


def _is_pid(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def ipc_dir(address: str) -> str:
    """``ipc://DIR/requests.sock`` (or ``ipc://DIR``) -> ``DIR``."""
    if not address.startswith("ipc://"):
        raise ValueError(
            f"{address!r} is not an ipc:// address: give the launcher's pid instead (--pid)"
        )
    path = address[len("ipc://") :]
    return os.path.dirname(path) if path.endswith(".sock") else path


def find_engine(address: str | None = None, pid: int | None = None) -> EngineProcesses:
    """The processes of the engine serving ``address`` (an ipc address), or of the engine
    whose launcher or stage has pid ``pid``."""
    if address is not None:
        directory = ipc_dir(address)
        record = read_engine_file(directory)
        if record is None:
            raise FileNotFoundError(f"no running engine found at {address} ({ENGINE_FILE})")
        launcher = int(record["pid"])
        recorded = {name: int(p) for name, p in record.get("stages", {}).items()}
        # A launcher killed outright leaves its record behind, and its pids may have been
        # reused: only live stages of that launcher are signalled.
        stages = {name: p for name, p in recorded.items() if _is_stage(p, name, launcher)}
        if not stages:
            raise ProcessLookupError(
                f"no running engine at {address}: its {ENGINE_FILE} is left from an engine "
                f"(launcher pid {launcher}) that is gone"
            )
        return EngineProcesses(launcher, record.get("runtime_dir"), stages, record.get("http"))
    if pid is None:
        raise ValueError("give an engine address or a pid")
    title = process_title(pid)
    if title is None:
        raise ProcessLookupError(f"no process {pid}")
    launcher = _parent(pid) if title.startswith("mpengine: ") else pid
    stages = {}
    for child in _children(launcher):
        child_title = process_title(child) or ""
        if child_title.startswith("mpengine: "):
            stages[child_title.removeprefix("mpengine: ")] = child
    if not stages:
        raise ProcessLookupError(f"process {pid} is not an mpengine launcher or stage")
    runtime_dir = next(filter(None, map(_stack_file_dir, stages.values())), None)
    return EngineProcesses(launcher, runtime_dir, stages)


def _is_stage(pid: int, name: str, launcher: int) -> bool:
    """Whether ``pid`` is the live stage ``name`` of the launcher ``launcher``."""
    try:
        title = process_title(pid) or ""
        # (a data-parallel replica's stages are titled "mpengine: STAGE dpN")
        named = title == f"mpengine: {name}" or title.startswith(f"mpengine: {name} dp")
        return named and _parent(pid) == launcher
    except OSError:  # gone meanwhile
        return False


def _stack_file_dir(pid: int) -> str | None:
    """The runtime directory of a stage: where the stack file it holds open lies."""
    with contextlib.suppress(OSError):
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            with contextlib.suppress(OSError):
                target = os.readlink(fd)
                if os.path.basename(target).startswith("stacks-"):
                    return os.path.dirname(target)
    return None


def process_title(pid: int) -> str | None:
    """What ``ps`` shows for ``pid`` (a stage's title is ``mpengine: STAGE``)."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    return raw.replace(b"\0", b" ").decode(errors="replace").strip()


def process_state(pid: int) -> str:
    """The kernel's one-letter state of ``pid`` (``T``: stopped), ``?`` when unknown."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return "?"
    return stat.rsplit(")", 1)[1].split()[0]


def _parent(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat.rsplit(")", 1)[1].split()[1])


def _children(pid: int) -> list[int]:
    children = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            children += [int(c) for c in (task / "children").read_text().split()]
    return children

"""Finding a running engine's processes, and looking inside them without stopping it.

The launcher writes ``engine.json`` beside the ipc sockets (``ipc://DIR`` -> ``DIR``): its
own pid, the runtime directory and each stage's pid (``mpengine serve`` adds its HTTP
address). ``mpengine stacks`` and ``mpengine top`` start from there, or from a pid.

Stacks: every stage registers ``faulthandler`` on ``STACKS_SIGNAL`` at start, writing to
``RUNTIME_DIR/stacks-STAGE.txt``; it dumps every thread even while the stage is stuck in C
code, and the engine goes on. ``py-spy dump`` is used instead when it is installed (it
shows native frames too), falling back to faulthandler when it fails (no ptrace rights).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from mpengine.addresses import connectable
from mpengine.envs import TOKEN_FILE_HELP, auth_token, write_atomically
from mpengine.runtime.stage import STACKS_SIGNAL

ENGINE_FILE = "engine.json"
DUMP_TIMEOUT_S = 5.0
DUMP_QUIET_S = 0.1  # a dump is complete once its file stops growing for this long


# -- the engine file -------------------------------------------------------------------------


def write_engine_file(directory: str, record: dict) -> None:
    """Write ``DIR/engine.json``: aside, then renamed, so that a reader never sees half a
    file."""
    write_atomically(Path(directory) / ENGINE_FILE, json.dumps(record).encode())


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
        return process_title(pid) == f"mpengine: {name}" and _parent(pid) == launcher
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


# -- stacks ----------------------------------------------------------------------------------


def dump_stacks(
    engine: EngineProcesses, use_py_spy: bool | None = None, timeout: float = DUMP_TIMEOUT_S
) -> dict[str, str]:
    """Each process's current Python stacks, by label (``scheduler``, ``executor``...,
    ``launcher`` when it registered for dumps too, as ``mpengine serve`` does). A process
    that does not dump within ``timeout`` seconds (stopped, or stuck with signals blocked)
    is reported as such; the others are not held up by it."""
    targets = dict(engine.stages)
    if engine.runtime_dir and os.path.exists(
        os.path.join(engine.runtime_dir, _stack_file("launcher"))
    ):
        targets = {"launcher": engine.launcher_pid, **targets}
    if use_py_spy is None:
        use_py_spy = shutil.which("py-spy") is not None
    dumps = {}
    for label, pid in targets.items():
        text = _py_spy(pid) if use_py_spy else None
        if text is None:
            text = _faulthandler_dump(engine.runtime_dir, label, pid, timeout)
        dumps[label] = text
    return dumps


def _stack_file(label: str) -> str:
    return f"stacks-{label}.txt"


def _py_spy(pid: int) -> str | None:
    try:
        done = subprocess.run(
            ["py-spy", "dump", "--pid", str(pid)],
            capture_output=True,
            text=True,
            timeout=2 * DUMP_TIMEOUT_S,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


def _faulthandler_dump(runtime_dir: str | None, label: str, pid: int, timeout: float) -> str:
    """Signal ``pid`` and return what it appended to its stack file."""
    if runtime_dir is None:
        return "(no runtime directory known: cannot read its stack dump)"
    path = Path(runtime_dir) / _stack_file(label)
    if not path.exists():
        return f"(no {path.name}: this process does not dump its stacks)"
    start = path.stat().st_size
    try:
        os.kill(pid, STACKS_SIGNAL)
    except ProcessLookupError:
        return "(the process has exited)"
    deadline = time.monotonic() + timeout
    size, changed = start, time.monotonic()
    while time.monotonic() < deadline:
        now_size = path.stat().st_size
        if now_size != size:
            size, changed = now_size, time.monotonic()
        elif size > start and time.monotonic() - changed >= DUMP_QUIET_S:
            break
        time.sleep(0.01)
    if size == start:
        state = process_state(pid)
        why = "it is stopped (SIGSTOP)" if state == "T" else f"process state {state}"
        return f"(no dump within {timeout:g} s: {why}; it will dump when it runs again)"
    with open(path, "rb") as dump:
        dump.seek(start)
        return dump.read(size - start).decode(errors="replace")


def format_stacks(dumps: dict[str, str], engine: EngineProcesses) -> str:
    pids = {"launcher": engine.launcher_pid, **engine.stages}
    parts = []
    for label, text in dumps.items():
        parts.append(f"=== {label} (pid {pids[label]}) ===\n{text.rstrip()}\n")
    return "\n".join(parts)


# -- top -------------------------------------------------------------------------------------


@dataclass(slots=True)
class Sample:
    """One look at the engine: its stats, and when."""

    stats: object  # EngineStats
    at: float


def take_sample(client) -> Sample:
    return Sample(client.stats(), time.monotonic())


def render_top(before: Sample, after: Sample, title: str) -> str:
    """The ``mpengine top`` screen for the interval between two samples."""
    s, p = after.stats, before.stats
    dt = max(after.at - before.at, 1e-9)
    used = 1.0 - s.num_free_blocks / s.num_blocks if s.num_blocks else 0.0
    steps_per_s = (s.done - p.done) / dt
    finished_per_s = (s.finished - p.finished) / dt
    generated = (getattr(s, "generated_tokens", 0) - getattr(p, "generated_tokens", 0)) / dt
    computed = (getattr(s, "computed_tokens", 0) - getattr(p, "computed_tokens", 0)) / dt
    lines = [
        title,
        f"requests  {s.num_running} running, {s.num_waiting} waiting, "
        f"{s.num_preempted} preempted   finished {finished_per_s:.1f}/s   "
        f"preemptions {s.preemptions}",
        f"KV cache  {used:6.1%} of {s.num_blocks} blocks",
        f"rate      {generated:.1f} tokens/s generated   {computed:.1f} tokens/s computed   "
        f"{steps_per_s:.1f} steps/s   lockstep lag {s.step - s.done} steps",
    ]
    lines += _stage_lines(getattr(p, "stages", {}), getattr(s, "stages", {}), dt)
    return "\n".join(lines)


def _stage_lines(before: dict, after: dict, dt: float) -> list[str]:
    """Each stage's busy share of the interval and its ms per step, and the verdict."""
    if not after:
        return ["stages    (no step breakdown from this engine)"]
    lines = [f"{'stage':<10}{'busy':>7}{'ms/step':>10}"]
    shares = {}
    for stage, times in after.items():
        prev = before.get(stage)
        busy = times.busy - (prev.busy if prev else 0.0)
        steps = times.steps - (prev.steps if prev else 0)
        shares[stage] = busy / dt
        per_step = f"{1000 * busy / steps:.2f}" if steps else "-"
        lines.append(f"{stage:<10}{shares[stage]:>7.0%}{per_step:>10}")
    lines.append(verdict(shares))
    return lines


def verdict(shares: dict[str, float]) -> str:
    """Which stage limits the engine, from each stage's busy share of the time."""
    if not shares:
        return "verdict   no stages reported"
    stage, share = max(shares.items(), key=lambda item: item[1])
    if share < 0.5:
        return (
            f"verdict   no stage is saturated (busiest: {stage}, {share:.0%}): "
            "the engine waits for work"
        )
    return f"verdict   the {stage} is the bottleneck: busy {share:.0%} of the time"


# -- the commands ----------------------------------------------------------------------------


def add_stacks_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("address", nargs="?", help="the engine's ipc:// address")
    parser.add_argument("--pid", type=int, help="the pid of the engine's launcher or a stage")
    parser.add_argument(
        "--faulthandler",
        action="store_true",
        help="use the stages' own dumps even if py-spy is installed",
    )
    parser.add_argument(
        "--timeout",
        type=positive_float,
        default=DUMP_TIMEOUT_S,
        help=f"seconds to wait for each dump (default: {DUMP_TIMEOUT_S:g})",
    )


def cmd_stacks(args: argparse.Namespace) -> int:
    """``mpengine stacks``: every thread's stack, for each process of the engine."""
    if (args.address is None) == (args.pid is None):
        raise SystemExit("mpengine stacks: give an ipc:// ADDRESS or --pid PID")
    try:
        engine = find_engine(args.address, args.pid)
    except (ValueError, OSError) as exc:
        raise SystemExit(f"mpengine stacks: {exc}") from None
    dumps = dump_stacks(engine, False if args.faulthandler else None, args.timeout)
    print(format_stacks(dumps, engine))
    return 0


def add_top_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("address", help="the engine's request address (ipc://... or tcp://...)")
    parser.add_argument(
        "--interval",
        type=positive_float,
        default=1.0,
        help="seconds between refreshes (default: 1)",
    )
    parser.add_argument("--once", action="store_true", help="print one screen and exit")
    parser.add_argument("--auth-token", default=None, help="the engine's auth token, if any")
    parser.add_argument("--auth-token-file", default=None, help=TOKEN_FILE_HELP)
    parser.add_argument(
        "--timeout",
        type=positive_float,
        default=10.0,
        help="seconds to wait for the engine (default: 10)",
    )


def positive_float(text: str) -> float:
    """An argparse type: a finite number of seconds above zero."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, not {text}")
    return value


def check_address(address: str) -> None:
    """Exit with one line unless ``address`` is an engine's address (an ipc socket that
    exists): a client would wait out its whole handshake timeout."""
    if not address.startswith(("ipc://", "tcp://")):
        raise SystemExit(f"mpengine: {address!r} is not an ipc:// or tcp:// address")
    if not address.startswith("ipc://"):
        return
    path = connectable(address).removeprefix("ipc://")
    if not os.path.exists(path):
        raise SystemExit(f"mpengine: no engine at {address}: {path} does not exist")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        try:
            probe.connect(path)
        except ConnectionRefusedError:  # a socket file left by an engine that was killed
            raise SystemExit(f"mpengine: no engine at {address}: nothing listens there") from None
        except OSError:
            pass  # the client's own attempt will say what is wrong


def cmd_top(args: argparse.Namespace) -> int:
    """``mpengine top``: a live view, refreshed every ``--interval`` seconds."""
    from mpengine.client.sync_client import Client

    check_address(args.address)
    try:
        token = auth_token(args.auth_token, args.auth_token_file)
    except ValueError as exc:
        raise SystemExit(f"mpengine: {exc}") from None
    with Client(args.address, timeout=args.timeout, auth_token=token) as client:
        title = f"mpengine top  {client.info.model}  ({client.info.runtime}, {args.address})"
        before = take_sample(client)
        try:
            while True:
                time.sleep(args.interval)
                after = take_sample(client)
                screen = render_top(before, after, title)
                if args.once:
                    print(screen)
                    return 0
                clear = "\x1b[H\x1b[2J" if sys.stdout.isatty() else "\n"  # home, clear
                print(clear + screen, flush=True)
                before = after
        except KeyboardInterrupt:
            return 0

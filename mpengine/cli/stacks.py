"""``mpengine stacks``: every thread's stack of each process of a running engine, without
stopping it.

Every stage registers ``faulthandler`` on ``STACKS_SIGNAL`` at start, writing to
``RUNTIME_DIR/stacks-STAGE.txt``; it dumps every thread even while the stage is stuck in C
code, and the engine goes on. ``py-spy dump`` is used instead when it is installed (it
shows native frames too), falling back to faulthandler when it fails (no ptrace rights).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import time
from pathlib import Path

from mpengine.cli.args import engine_address, positive_float
from mpengine.runtime.engine_file import EngineProcesses, find_engine, process_state
from mpengine.runtime.stage import STACKS_SIGNAL

DUMP_TIMEOUT_S = 5.0
DUMP_QUIET_S = 0.1  # a dump is complete once its file stops growing for this long


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("stacks", help="print every thread's stack of each engine process")
    parser.add_argument(
        "address",
        nargs="?",
        help="the engine's ipc:// address (a data-parallel engine's: its replicas', separated "
        "by commas), or `mpengine serve`'s URL",
    )
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
    parser.set_defaults(func=cmd_stacks)


def cmd_stacks(args: argparse.Namespace) -> int:
    """``mpengine stacks``: every thread's stack, for each process of the engine."""
    if (args.address is None) == (args.pid is None):
        raise SystemExit("mpengine stacks: give an ipc:// ADDRESS or --pid PID")
    # (a data-parallel engine's replicas: each its own processes, under its address)
    addresses = [None] if args.address is None else engine_address(args.address).split(",")
    for address in addresses:
        try:
            engine = find_engine(address, args.pid)
        except (ValueError, OSError) as exc:
            raise SystemExit(f"mpengine stacks: {exc}") from None
        dumps = dump_stacks(engine, False if args.faulthandler else None, args.timeout)
        if len(addresses) > 1:
            print(f"##### {address}\n")
        print(format_stacks(dumps, engine))
    return 0


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

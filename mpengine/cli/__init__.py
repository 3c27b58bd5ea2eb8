"""``mpengine generate | chat | embed | serve | stats | stacks | top``: the command line.

One module per command (``generate``, ``chat``, ``embed``, ``serve`` with ``stats``,
``stacks``, ``top``), the flags they share in ``args`` (engine flags map one to one onto
``EngineConfig`` fields, ``--max-num-seqs`` -> ``max_num_seqs``, their help from
``config.HELP``), and in ``remote`` the engine ``generate`` and ``chat`` talk to (launched,
or running: IPC or HTTP). Here: the parser and ``main``, which turns what users cause into
one line and an exit status.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator

from mpengine.cli import chat, embed, generate, serve, stacks, top
from mpengine.cli.args import config_from_args, parse_bytes
from mpengine.errors import (
    EngineDeadError,
    EngineStartError,
    InvalidRequestError,
    RequestFailedError,
)

__all__ = ["build_parser", "config_from_args", "main", "parse_bytes"]

# Commands that stop, like Ctrl-C, on SIGTERM or SIGHUP (serve drains on SIGTERM itself).
ONE_SHOT = ("generate", "chat", "embed")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mpengine",
        description="An LLM engine core whose scheduler, executor and output processor run as "
        "three OS processes.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    generate.add_parser(sub)
    chat.add_parser(sub)
    embed.add_parser(sub)
    serve.add_parsers(sub)  # serve, stats
    stacks.add_parser(sub)
    top.add_parser(sub)
    return parser


class Terminated(BaseException):
    """SIGTERM or SIGHUP (``timeout``, ``docker stop``, a closed terminal): unwinds like
    Ctrl-C, so that the engine is shut down and its segments removed on the way out."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum


@contextlib.contextmanager
def _terminate_like_interrupt() -> Iterator[None]:
    """While inside: SIGTERM and SIGHUP, when their handlers are the default, raise
    :class:`Terminated` (in the main thread; restored on the way out)."""

    def stop(signum: int, _frame: object) -> None:
        raise Terminated(signum)

    saved = {}
    if threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGTERM, signal.SIGHUP):
            if signal.getsignal(signum) is signal.SIG_DFL:
                saved[signum] = signal.signal(signum, stop)
    try:
        yield
    finally:
        for signum, handler in saved.items():
            signal.signal(signum, handler)


def main(argv: list[str] | None = None) -> int:
    """Run a command; what users cause (a refused request, an engine that cannot start or
    died, an address nobody serves) is one line on stderr and exit status 1, not a
    traceback; Ctrl-C stops the engine and exits 130; a closed output pipe (``| head``)
    stops it quietly with 141, as a command killed by SIGPIPE."""
    args = build_parser().parse_args(argv)
    one_shot = args.command in ONE_SHOT
    try:
        with _terminate_like_interrupt() if one_shot else contextlib.nullcontext():
            return args.func(args)
    except Terminated as exc:
        print(f"mpengine: {exc}", file=sys.stderr)
        return 128 + exc.signum
    except BrokenPipeError:  # `| head`: the reader has what it wanted (the engine stopped)
        with contextlib.suppress(OSError):  # (no flush error at exit either)
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE
    except InvalidRequestError as exc:
        print(f"mpengine: the engine refused the request: {exc}", file=sys.stderr)
    except (
        EngineStartError,
        EngineDeadError,
        RequestFailedError,
        ConnectionError,
        PermissionError,  # (an engine that refused the auth token)
    ) as exc:
        print(f"mpengine: {exc}", file=sys.stderr)
    except TimeoutError as exc:
        print(f"mpengine: timed out: {exc}", file=sys.stderr)
    except KeyboardInterrupt:  # the engine was shut down on the way out
        print("mpengine: interrupted", file=sys.stderr)
        return 130
    return 1

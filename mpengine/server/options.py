"""The flags of ``mpengine serve`` beyond the engine's (no heavy imports: the CLI builds
its parser from here whatever the command)."""

from __future__ import annotations

import argparse


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("HTTP")
    group.add_argument("--host", default="127.0.0.1", help="HTTP address (default: 127.0.0.1)")
    group.add_argument(
        "--port", type=port, default=8000, help="HTTP port (default: 8000; 0: any free port)"
    )
    group.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY'")
    group.add_argument("--api-key-file", default=None, help="read the API key from this file")
    group.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="the model's name(s) in the API (default: --model)",
    )
    group.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        help="on SIGTERM/SIGINT, seconds admitted requests may take to finish (default: 30)",
    )
    group.add_argument(
        "--stall-timeout",
        type=float,
        default=60.0,
        help="unhealthy once the engine has work but finished no step for this long (default: 60)",
    )
    group.add_argument(
        "--uvicorn-log-level", default="warning", help="uvicorn's log level (default: warning)"
    )


def port(text: str) -> int:
    """argparse type of a TCP port."""
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{value} is not a port (0-65535)")
    return value

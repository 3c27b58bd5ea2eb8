"""The flags of ``mpengine serve`` beyond the engine's (no heavy imports: the CLI builds
its parser from here whatever the command)."""

from __future__ import annotations

import argparse
import json
import math

from mpengine.server.tool_parsers import PARSERS


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("HTTP")
    group.add_argument("--host", default="127.0.0.1", help="HTTP address (default: 127.0.0.1)")
    group.add_argument(
        "--port", type=port, default=8000, help="HTTP port (default: 8000; 0: any free port)"
    )
    group.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' (default: $MPENGINE_API_KEY, else vLLM's "
        "$VLLM_API_KEY; a key on the command line is readable by every user in the process "
        "list: prefer the environment or --api-key-file)",
    )
    group.add_argument("--api-key-file", default=None, help="read the API key from this file")
    group.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="the model's name(s) in the API (default: --model)",
    )
    group.add_argument(
        "--chat-template",
        default=None,
        help="a chat template (a file, or the template's text) to use instead of the model's",
    )
    group.add_argument(
        "--chat-template-content-format",
        choices=("auto", "string", "openai"),
        default="auto",
        help="how a message's content reaches the template: one string, or OpenAI's list of "
        "text parts (default: auto, as the template reads it)",
    )
    group.add_argument(
        "--drain-timeout",
        type=seconds,
        default=30.0,
        help="on SIGTERM/SIGINT, seconds admitted requests may take to finish; a second "
        "signal stops at once (default: 30)",
    )
    group.add_argument(
        "--stall-timeout",
        type=seconds,
        default=60.0,
        help="unhealthy once the engine has work but finished no step for this long (default: 60)",
    )
    group.add_argument("--ssl-keyfile", default=None, help="serve HTTPS with this key file")
    group.add_argument(
        "--ssl-certfile", default=None, help="serve HTTPS with this certificate file"
    )
    _add_tool_args(parser)
    _add_limit_args(parser)
    _add_log_args(parser)
    _add_cors_args(parser)


def check_serve_args(args: argparse.Namespace) -> None:
    """Refuse flag combinations that cannot work, before anything loads."""
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        raise SystemExit(
            "mpengine: --enable-auto-tool-choice needs --tool-call-parser NAME "
            f"({', '.join(PARSERS)}): the format the model writes its calls in"
        )


def _add_tool_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("tool calling (tool_choice 'auto')")
    group.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help="let the model decide to call tools (tool_choice 'auto', the default with "
        "tools); its calls are read from its output by --tool-call-parser",
    )
    group.add_argument(
        "--tool-call-parser",
        choices=list(PARSERS),
        default=None,
        help="the model's tool-call format: hermes (<tool_call> JSON, Qwen), llama3_json, "
        "mistral ([TOOL_CALLS])",
    )


def _add_limit_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("limits (clients that would hold the server)")
    group.add_argument(
        "--max-connections",
        type=int,
        default=None,
        help="HTTP connections served at once; past them a 503 at once (default: 8192, or "
        "what the open-file limit allows, raised as an engine raises it: to 65,536 within "
        "the hard limit)",
    )
    group.add_argument(
        "--http-head-timeout",
        type=seconds,
        default=10.0,
        help="close a connection whose request line and headers take longer than this to "
        "arrive (a slow sender holds a connection otherwise; default: 10)",
    )
    group.add_argument(
        "--http-body-timeout",
        type=seconds,
        default=60.0,
        help="answer 408 to a request whose body takes longer than this to arrive (default: 60)",
    )
    group.add_argument(
        "--stream-stall-timeout",
        type=seconds,
        default=10.0,
        help="abort a stream whose client has read nothing for this long: its outputs "
        "would pile up in the server (default: 10)",
    )


def _add_log_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("logs")
    group.add_argument(
        "--uvicorn-log-level",
        type=str.lower,
        choices=("critical", "error", "warning", "info", "debug", "trace"),
        default="warning",
        help="uvicorn's log level (default: warning)",
    )
    group.add_argument(
        "--disable-uvicorn-access-log",
        action="store_true",
        help="no access line per HTTP request (method, path, status, duration)",
    )
    group.add_argument(
        "--enable-log-requests",
        action="store_true",
        help="log each request's parameters and prompt lengths (the prompt's text too at "
        "--log-level debug)",
    )
    group.add_argument(
        "--disable-log-requests",
        action="store_true",
        help="vLLM's older flag: requests are not logged unless --enable-log-requests",
    )


def _add_cors_args(parser: argparse.ArgumentParser) -> None:
    cors = parser.add_argument_group("CORS (browsers calling the API from another origin)")
    for name, what in (("origins", "origins"), ("methods", "methods"), ("headers", "headers")):
        cors.add_argument(
            f"--allowed-{name}",
            type=json_list,
            default=["*"],
            help=f'{what} allowed, as a JSON list (default: ["*"], as vLLM)',
        )
    cors.add_argument(
        "--allow-credentials", action="store_true", help="allow credentials (cookies, auth)"
    )


def json_list(text: str) -> list[str]:
    """argparse type of a JSON list of strings (vLLM's form: '["http://a.example"]')."""
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a JSON list of strings")
    return value


def seconds(text: str) -> float:
    """argparse type of a duration: finite, not negative."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0.0 <= value < math.inf:
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration in seconds (>= 0)")
    return value


def port(text: str) -> int:
    """argparse type of a TCP port."""
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{value} is not a port (0-65535)")
    return value

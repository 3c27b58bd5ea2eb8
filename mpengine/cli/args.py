"""The flags commands share: engine flags (one per ``EngineConfig`` field, their help from
``config.HELP``), sampling flags, the model as a positional argument, a running engine's
address, and how much the engine logs."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import re
import socket
import sys
import types
import typing
from collections.abc import Callable, Iterator
from decimal import Decimal
from typing import Any

import msgspec

from mpengine.addresses import connectable
from mpengine.config import HELP, EngineConfig
from mpengine.envs import TOKEN_FILE_HELP, auth_token

NONE = object()  # an engine flag not given (its dest holds this, not a default)


def _arg_type(annotation: object) -> tuple[type, list | None]:
    """The argparse type and choices of a config field's annotation."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        return _arg_type(args[0])
    if origin in (typing.Union, types.UnionType):
        (inner,) = [a for a in args if a is not type(None)]
        return _arg_type(inner)
    if origin is typing.Literal:
        return type(args[0]), list(args)
    return annotation, None  # type: ignore[return-value]


# Sizes in bytes, which the flags also take with a unit (binary: 4GiB, 4G, 512MiB, 1.5GiB).
BYTE_FIELDS = ("kv_cache_bytes", "swap_space", "ring_bytes", "max_request_bytes")
# Token counts, which take vLLM's human-readable form too (4k = 4000, 4K = 4096).
COUNT_FIELDS = ("max_model_len", "max_num_batched_tokens", "max_waiting_tokens")
_COUNT_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "K": 1 << 10, "M": 1 << 20}
_COUNT_UNITS["G"] = 1 << 30
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
# vLLM's names of the same flags, so its users' command lines work.
VLLM_ALIASES = {
    "prefix_caching": "--enable-prefix-caching",
    "tensor_parallel_size": "-tp",
    "data_parallel_size": "-dp",
}


def _dtype(text: str) -> str:
    return {"half": "float16", "float": "float32", "bf16": "bfloat16"}.get(text, text)


def _backend(text: str) -> str:
    return "mp" if text == "uni" else text


def _swap_space(text: str) -> int:
    """``--swap-space``: GiB when a bare number, as vLLM takes it (``4``), else a size."""
    try:
        return int(Decimal(text.strip()) * (1 << 30))
    except ArithmeticError:  # (decimal.InvalidOperation: not a bare number)
        return parse_bytes(text)


def parse_bytes(text: str) -> int:
    """``"4GiB"``, ``"4G"``, ``"4Gi"``, ``"4gb"``, ``"512MiB"``, ``"1.5GiB"`` or
    ``"4294967296"``: whole bytes (units are binary)."""
    match = re.fullmatch(
        r"\s*([0-9]{1,20}(?:\.[0-9]{1,9})?|\.[0-9]{1,9})\s*(?:([kmgtKMGT])(?:i?[bB]?)|[bB])?\s*",
        text,
    )
    if match is None:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a size: bytes, or a number with a unit (4GiB, 512MiB)"
        )
    number, unit = match.groups()
    return int(Decimal(number) * _UNITS[(unit or "").lower()])


def parse_count(text: str) -> int:
    """A token count as vLLM takes it: ``4096``, ``4k`` (4,000), ``4K`` (4,096), ``25.6k``,
    ``1M`` (2^20)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgKMG]?)\s*", text)
    if match is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a count: a number, or 4k, 4K, 1M")
    number, unit = match.groups()
    value = Decimal(number) * _COUNT_UNITS[unit]
    if value != value.to_integral_value():
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of tokens")
    return int(value)


def add_engine_args(parser: argparse.ArgumentParser, exclude: tuple[str, ...] = ()) -> None:
    """A flag per ``EngineConfig`` field but those of ``exclude``."""
    group = parser.add_argument_group("engine")
    hints = typing.get_type_hints(EngineConfig, include_extras=True)
    defaults = EngineConfig()
    for name in EngineConfig.__struct_fields__:
        if name in exclude:
            continue
        kind, choices = _arg_type(hints[name])
        default = getattr(defaults, name)
        help_text = HELP[name] + (f" (default: {default})" if default not in (None, "") else "")
        flags = ["--" + name.replace("_", "-")]
        if name in VLLM_ALIASES:
            flags.append(VLLM_ALIASES[name])
        if kind is bool:  # --flag / --no-flag
            action = argparse.BooleanOptionalAction
            group.add_argument(*flags, dest=name, action=action, default=NONE, help=help_text)
            continue
        if name == "swap_space":
            kind = _swap_space  # type: ignore[assignment]
        elif name in BYTE_FIELDS:
            kind = parse_bytes  # type: ignore[assignment]
        elif name in COUNT_FIELDS:
            kind = parse_count  # type: ignore[assignment]
        elif name == "log_level":  # (--log-level debug, as vLLM's takes it)
            kind = str.upper  # type: ignore[assignment]
        elif name == "dtype":  # vLLM's spellings too
            kind = _dtype  # type: ignore[assignment]
        elif name == "distributed_executor_backend":  # (vLLM's "uni": one process's, here mp)
            kind = _backend  # type: ignore[assignment]
        group.add_argument(
            *flags, dest=name, type=kind, choices=choices, default=NONE, help=help_text
        )
    group.add_argument("--auth-token-file", default=None, help=TOKEN_FILE_HELP)


def auth_token_from_args(args: argparse.Namespace) -> str | None:
    token = getattr(args, "auth_token", None)
    try:
        return auth_token(None if token is NONE else token, getattr(args, "auth_token_file", None))
    except ValueError as exc:
        raise SystemExit(f"mpengine: {exc}") from None


def given_engine_flags(args: argparse.Namespace) -> dict[str, object]:
    """The engine flags given, by config field."""
    return {
        name: getattr(args, name)
        for name in EngineConfig.__struct_fields__
        if getattr(args, name, NONE) is not NONE
    }


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    values = given_engine_flags(args)
    if (token := auth_token_from_args(args)) is not None:
        values["auth_token"] = token
    try:
        config = EngineConfig.from_kwargs(**values)
    except (msgspec.ValidationError, ValueError) as exc:
        # Name the flag, not the config field's path ("at `$.async_depth`").
        message = re.sub(r"`\$\.(\w+)`", lambda m: "--" + m[1].replace("_", "-"), str(exc))
        raise SystemExit(f"mpengine: invalid engine configuration: {message}") from None
    for note in _ignored(values, config):
        print(f"mpengine: note: {note}", file=sys.stderr)
    return config


def _ignored(given: dict[str, object], config: EngineConfig) -> list[str]:
    """Flags given that have no effect with the others (vLLM users pass some by habit)."""
    notes = []
    if "swap_space" in given and config.preemption_mode != "swap":
        notes.append("--swap-space has no effect without --preemption-mode swap")
    if "async_depth" in given and config.runtime == "serial":
        notes.append("--async-depth has no effect with --runtime serial (it plans each step)")
    if config.device == "cuda" and "kv_cache_bytes" in given:
        notes.append("--kv-cache-bytes has no effect on CUDA (--gpu-memory-utilization sizes it)")
    if config.device == "cpu":
        for name in ("gpu_memory_utilization", "enforce_eager"):
            if name in given:
                notes.append(f"--{name.replace('_', '-')} has no effect on the CPU")
    return notes


# -- the model, positional ---------------------------------------------------------------


def add_model_arg(parser: argparse.ArgumentParser, example: str) -> None:
    """``mpengine COMMAND MODEL``, as ``vllm serve MODEL``: the same as ``--model``."""
    parser.add_argument(
        "model_tag",
        nargs="?",
        default=None,
        metavar="MODEL",
        help=f"the model, as --model ({example})",
    )


def take_model_tag(args: argparse.Namespace) -> None:
    """The positional MODEL becomes ``--model`` (both given, and different: an error);
    ``args.model_given`` says whether either was."""
    args.model_given = args.model is not NONE or args.model_tag is not None
    if args.model_tag is not None:
        if args.model is not NONE and args.model != args.model_tag:
            raise SystemExit(f"mpengine: two models: {args.model_tag!r} and --model {args.model!r}")
        args.model = args.model_tag


# -- logging ---------------------------------------------------------------------------------


def quiet_by_default(args: argparse.Namespace) -> None:
    """Commands that print the model's text (generate, chat): the engine logs warnings and
    errors only, unless ``--log-level`` says otherwise."""
    if getattr(args, "log_level", NONE) is NONE:
        args.log_level = "WARNING"


# -- commands that print the model's text (generate, chat) ----------------------------------


def add_text_command_args(
    parser: argparse.ArgumentParser, what: str, max_tokens_default: str = "64"
) -> None:
    """MODEL (default ``smollm2-135m``), the sampling flags, ``--address`` of a running engine,
    and the engine flags of the engine launched otherwise."""
    add_model_arg(
        parser, f"`mpengine {parser.prog.split()[-1]} smollm2-135m`; default: smollm2-135m"
    )
    add_sampling_args(parser, max_tokens_default)
    add_address_args(parser, what)
    add_engine_args(parser, exclude=("address",))


def prepare_text_command(args: argparse.Namespace) -> None:
    """Before anything starts: MODEL as ``--model``, quiet logs, and bad sampling flags
    refused."""
    take_model_tag(args)
    quiet_by_default(args)
    sampling_from_args(args)


@contextlib.contextmanager
def command_logging(level: str, command: str) -> Iterator[None]:
    """While inside: this process's ``mpengine`` loggers (the launcher's, the client's) log
    at ``level`` to stderr, in the stages' format; the logging set up before is restored on
    the way out (``main`` may run inside another program, or a test)."""
    root = logging.getLogger("mpengine")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        logging.Formatter(
            f"%(asctime)s %(levelname)s mpengine.{command}[%(process)d] %(name)s: %(message)s"
        )
    )
    saved = root.level, root.propagate
    root.addHandler(handler)
    root.setLevel(level)
    root.propagate = False
    try:
        yield
    finally:
        root.removeHandler(handler)
        root.setLevel(saved[0])
        root.propagate = saved[1]


# -- sampling --------------------------------------------------------------------------------

# The CLI's own defaults of the fields a model's generation_config.json may set: used when
# neither the flag nor the model gives one (greedy, 64 tokens).
CLI_SAMPLING = {
    "max_tokens": 64,
    "temperature": 0.0,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": 0.0,
    "repetition_penalty": 1.0,
}
# Sampling flags that pass as they are (no model default).
_PLAIN_SAMPLING = ("n", "stop", "ignore_eos", "presence_penalty", "frequency_penalty", "logprobs")
_MODEL_DEFAULT = " (default: the model's generation_config.json, else %s)"


def add_sampling_args(parser: argparse.ArgumentParser, max_tokens_default: str = "64") -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument(
        "--max-tokens",
        type=int,
        help="tokens to generate at most" + _MODEL_DEFAULT % max_tokens_default,
    )
    group.add_argument("--temperature", type=float, help="0 is greedy" + _MODEL_DEFAULT % 0)
    group.add_argument("--top-p", type=float, help="nucleus sampling mass" + _MODEL_DEFAULT % 1)
    group.add_argument(
        "--top-k", type=int, help="keep the k most likely, 0: all" + _MODEL_DEFAULT % 0
    )
    group.add_argument("--min-p", type=float, help="drop tokens below p * max" + _MODEL_DEFAULT % 0)
    group.add_argument(
        "--sampling-seed",
        dest="sampling_seed",
        type=int,
        default=None,
        help="per-request seed (reproducible samples)",
    )
    group.add_argument("--n", type=int, default=1, help="samples per prompt")
    group.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    group.add_argument("--ignore-eos", action="store_true", help="do not stop at EOS")
    group.add_argument(
        "--repetition-penalty",
        type=float,
        help="divides the positive logits (multiplies the negative) of tokens in the prompt "
        "or output" + _MODEL_DEFAULT % 1,
    )
    group.add_argument(
        "--presence-penalty",
        type=float,
        default=0.0,
        help="subtracted from the logit of every token already generated (default: 0)",
    )
    group.add_argument(
        "--frequency-penalty",
        type=float,
        default=0.0,
        help="subtracted once per earlier occurrence in the output (default: 0)",
    )
    group.add_argument("--logprobs", type=int, default=None, help="top-N logprobs per token")


def given_sampling(args: argparse.Namespace) -> dict[str, object]:
    """The sampling flags given (by ``SamplingParams`` field), those left at a neutral
    default out: what a request to a server whose defaults are unknown carries."""
    given: dict[str, object] = {
        name: getattr(args, name) for name in CLI_SAMPLING if getattr(args, name) is not None
    }
    for name, neutral in (
        ("sampling_seed", None),
        ("n", 1),
        ("stop", []),
        ("ignore_eos", False),
        ("presence_penalty", 0.0),
        ("frequency_penalty", 0.0),
        ("logprobs", None),
    ):
        if getattr(args, name) != neutral:
            given["seed" if name == "sampling_seed" else name] = getattr(args, name)
    return given


def sampling_from_args(
    args: argparse.Namespace,
    model_defaults: dict | None = None,
    cli_defaults: dict | None = None,
):
    """The flags' parameters; those not given take the model's defaults, else the CLI's
    (``cli_defaults`` replacing some of :data:`CLI_SAMPLING`)."""
    from mpengine.protocol import SamplingParams

    given = {name: getattr(args, name) for name in CLI_SAMPLING}
    given = {name: value for name, value in given.items() if value is not None}
    plain = {name: getattr(args, name) for name in _PLAIN_SAMPLING}
    defaults = {**CLI_SAMPLING, **(cli_defaults or {}), **(model_defaults or {})}
    return validated(
        lambda: SamplingParams(**{**defaults, **given}, **plain, seed=args.sampling_seed),
        "sampling",
    )


def validated(make: Callable[[], Any], what: str) -> Any:
    """``make().validate()``, a bad value refused in one line (``what``: the parameters)."""
    try:
        return make().validate()
    except (msgspec.ValidationError, ValueError) as exc:
        raise SystemExit(f"mpengine: invalid {what} parameters: {exc}") from None


# -- a running engine ------------------------------------------------------------------------


def add_address_args(parser: argparse.ArgumentParser, what: str) -> None:
    """``--address`` of a running engine (instead of the engine flag of the same name: the
    address a launched engine binds, which a command that launches one for itself has no
    use for), and how to reach it."""
    group = parser.add_argument_group("a running engine")
    group.add_argument(
        "--address",
        dest="engine_address",
        default=None,
        metavar="ADDR",
        help=f"{what} a running engine instead of launching one: its request address "
        "(ipc://... or tcp://...; the engine flags but --auth-token then have no effect) or "
        "the URL of `mpengine serve` (http[s]://HOST:PORT; sampling flags not given take "
        "the server's defaults: the model's generation_config.json, else OpenAI's)",
    )
    group.add_argument(
        "--api-key",
        default=None,
        help="the server's API key, with an http:// address (default: $MPENGINE_API_KEY)",
    )
    group.add_argument(
        "--timeout",
        type=float,
        default=30.0,
        help="seconds to wait for the running engine to answer the handshake (default: 30)",
    )


def add_running_engine_args(parser: argparse.ArgumentParser) -> None:
    """A running engine's address, and how to reach it (``stats``, ``top``)."""
    parser.add_argument(
        "address",
        help="the engine's request address (ipc://... or tcp://...; a data-parallel engine's "
        "replicas' separated by commas, as `mpengine serve` prints them), or the URL of "
        "`mpengine serve` on this host",
    )
    parser.add_argument(
        "--timeout",
        type=positive_float,
        default=10.0,
        help="seconds to wait for the engine (default: 10)",
    )
    parser.add_argument("--auth-token", default=None, help="the engine's auth token, if any")
    parser.add_argument("--auth-token-file", default=None, help=TOKEN_FILE_HELP)


def running_engine(args: argparse.Namespace):
    """A ``Client`` of the engine at ``args.address`` (see :func:`add_running_engine_args`)."""
    from mpengine.client.sync_client import Client

    args.address = engine_address(args.address)
    check_address(args.address)
    token = auth_token_from_args(args)
    return Client(args.address, timeout=args.timeout, auth_token=token)


def positive_float(text: str) -> float:
    """An argparse type: a finite number of seconds above zero."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, not {text}")
    return value


def engine_address(address: str) -> str:
    """``address``, or for ``mpengine serve``'s URL on this host the ipc address of its
    engine (``stats``, ``top`` and ``stacks`` talk to the engine, not to the HTTP API)."""
    from mpengine.runtime.engine_file import address_of_url

    if not address.startswith(("http://", "https://")):
        return address
    try:
        return address_of_url(address)
    except LookupError as exc:
        raise SystemExit(f"mpengine: {exc}") from None


def check_address(address: str) -> None:
    """Exit with one line unless ``address`` is an engine's address (an ipc socket that
    exists; a data-parallel engine's: each of its replicas', separated by commas): a
    client would wait out its whole handshake timeout."""
    if "," in address:
        for replica in address.split(","):
            check_address(replica)
        return
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

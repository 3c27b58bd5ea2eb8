"""``mpengine generate | embed | serve | stats | stacks | top``: the command line.

Engine flags map one to one onto ``EngineConfig`` fields (``--max-num-seqs`` ->
``max_num_seqs``); their help comes from ``config.HELP``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import sys
import threading
import time
import types
import typing
from collections.abc import Iterator
from decimal import Decimal

import msgspec

from mpengine.config import HELP, EngineConfig
from mpengine.envs import TOKEN_FILE_HELP, auth_token
from mpengine.errors import (
    EngineDeadError,
    EngineStartError,
    InvalidRequestError,
    RequestFailedError,
)
from mpengine.runtime.diagnose import (
    add_stacks_args,
    add_top_args,
    check_address,
    cmd_stacks,
    cmd_top,
    positive_float,
)
from mpengine.server.options import add_serve_args

_NONE = object()


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
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
# vLLM's names of the same flags, so its users' command lines work.
VLLM_ALIASES = {"prefix_caching": "--enable-prefix-caching"}


def _dtype(text: str) -> str:
    return {"half": "float16", "float": "float32", "bf16": "bfloat16"}.get(text, text)


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


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine")
    hints = typing.get_type_hints(EngineConfig, include_extras=True)
    defaults = EngineConfig()
    for name in EngineConfig.__struct_fields__:
        kind, choices = _arg_type(hints[name])
        default = getattr(defaults, name)
        help_text = HELP[name] + (f" (default: {default})" if default not in (None, "") else "")
        flags = ["--" + name.replace("_", "-")]
        if name in VLLM_ALIASES:
            flags.append(VLLM_ALIASES[name])
        if kind is bool:  # --flag / --no-flag
            action = argparse.BooleanOptionalAction
            group.add_argument(*flags, dest=name, action=action, default=_NONE, help=help_text)
            continue
        if name in BYTE_FIELDS:
            kind = parse_bytes  # type: ignore[assignment]
        elif name == "log_level":  # (--log-level debug, as vLLM's takes it)
            kind = str.upper  # type: ignore[assignment]
        elif name == "dtype":  # vLLM's spellings too
            kind = _dtype  # type: ignore[assignment]
        group.add_argument(
            *flags, dest=name, type=kind, choices=choices, default=_NONE, help=help_text
        )
    group.add_argument("--auth-token-file", default=None, help=TOKEN_FILE_HELP)


def auth_token_from_args(args: argparse.Namespace) -> str | None:
    token = getattr(args, "auth_token", None)
    try:
        return auth_token(None if token is _NONE else token, getattr(args, "auth_token_file", None))
    except ValueError as exc:
        raise SystemExit(f"mpengine: {exc}") from None


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    values = {
        name: getattr(args, name)
        for name in EngineConfig.__struct_fields__
        if getattr(args, name, _NONE) is not _NONE
    }
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
_MODEL_DEFAULT = " (default: the model's generation_config.json, else %s)"


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument(
        "--max-tokens", type=int, help="tokens to generate at most" + _MODEL_DEFAULT % 64
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


def sampling_from_args(args: argparse.Namespace, model_defaults: dict | None = None):
    """The flags' parameters; those not given take the model's defaults, else the CLI's."""
    from mpengine.protocol import SamplingParams

    given = {name: getattr(args, name) for name in CLI_SAMPLING}
    given = {name: value for name, value in given.items() if value is not None}
    try:
        return SamplingParams(
            **{**CLI_SAMPLING, **(model_defaults or {}), **given},
            seed=args.sampling_seed,
            n=args.n,
            stop=args.stop,
            ignore_eos=args.ignore_eos,
            presence_penalty=args.presence_penalty,
            frequency_penalty=args.frequency_penalty,
            logprobs=args.logprobs,
        ).validate()
    except (msgspec.ValidationError, ValueError) as exc:
        raise SystemExit(f"mpengine: invalid sampling parameters: {exc}") from None


def cmd_generate(args: argparse.Namespace) -> int:
    from mpengine.launch import Engine

    params = sampling_from_args(args)
    prompts = args.prompt or ["The quick brown fox"]
    stream = args.stream and len(prompts) == 1 and params.n == 1 and not args.json
    if args.stream and not stream:
        print(
            "mpengine: --stream prints one prompt's text with n = 1, not as --json; "
            "printing the outputs when they are done",
            file=sys.stderr,
        )
    with Engine(config_from_args(args)) as engine, engine.client() as client:
        params = sampling_from_args(args, client.info.sampling_defaults)
        start = time.perf_counter()
        if stream:
            from mpengine.client import CompletionOutput, RequestOutput

            whole = CompletionOutput(0, logprobs=[] if params.logprobs is not None else None)
            sys.stdout.write(prompts[0])
            for delta in client.stream(prompts[0], params):
                sys.stdout.write(delta.text)
                sys.stdout.flush()
                whole.text += delta.text
                whole.token_ids += delta.token_ids
                whole.finish_reason = delta.finish_reason
                whole.error = delta.outputs[0].error or whole.error
                if whole.logprobs is not None:
                    whole.logprobs += delta.outputs[0].logprobs or []
            sys.stdout.write("\n")
            outputs = [RequestOutput("", [], [whole], finished=True)]
        else:
            outputs = client.generate_many(prompts, params)
        elapsed = time.perf_counter() - start
    for prompt, out in zip(prompts, outputs, strict=True):
        for sample in out.outputs:
            if stream:
                _print_tokens(sample)
            elif args.json:
                record = {
                    "prompt": prompt,
                    "index": sample.index,
                    "text": sample.text,
                    "token_ids": sample.token_ids,
                    "finish_reason": sample.finish_reason,
                }
                if sample.error is not None:
                    record["error"] = sample.error
                if sample.logprobs is not None:
                    # Per token: [token id, logprob] pairs, the sampled token first.
                    record["logprobs"] = [list(map(list, step.items())) for step in sample.logprobs]
                print(json.dumps(record, ensure_ascii=False))
            else:
                print(f"{prompt}{sample.text}")
                _print_tokens(sample)
    num_tokens = sum(len(s.token_ids) for o in outputs for s in o.outputs)
    print(
        f"{num_tokens} tokens in {elapsed:.2f} s ({num_tokens / elapsed:.1f} tokens/s)",
        file=sys.stderr,
    )
    failed = [s for o in outputs for s in o.outputs if s.finish_reason == "error"]
    for sample in failed:
        print(f"mpengine: sample {sample.index} failed: {sample.error}", file=sys.stderr)
    return 1 if failed else 0


def _print_tokens(sample) -> None:
    """A sample's token count, finish reason and (when asked) each token's logprobs."""
    print(f"  [{len(sample.token_ids)} tokens, finish_reason={sample.finish_reason}]")
    for token_id, step in zip(sample.token_ids, sample.logprobs or [], strict=False):
        top = "  ".join(f"{t}:{lp:.3f}" for t, lp in step.items() if t != token_id)
        print(f"  {token_id}: {step.get(token_id, float('nan')):.3f}  top: {top}")


def pooling_from_args(args: argparse.Namespace):
    from mpengine.protocol import PoolingParams

    try:
        return PoolingParams(
            normalize=args.normalize,
            dimensions=args.dimensions,
            truncate_prompt_tokens=args.truncate_prompt_tokens,
        ).validate()
    except (msgspec.ValidationError, ValueError) as exc:
        raise SystemExit(f"mpengine: invalid pooling parameters: {exc}") from None


def cmd_embed(args: argparse.Namespace) -> int:
    from mpengine.launch import Engine

    params = pooling_from_args(args)
    with Engine(config_from_args(args)) as engine, engine.client() as client:
        if client.info.pooling is None:
            if engine.config.pooling == "none":
                raise SystemExit("mpengine: --pooling none turns embeddings off")
            raise SystemExit(
                f"mpengine: the model {engine.config.model!r} cannot embed (give an embedding "
                "model, or --pooling last|mean|cls to pool a generation model's hidden states)"
            )
        start = time.perf_counter()
        outputs = client.embed_many(args.text, params)
        elapsed = time.perf_counter() - start
    for index, out in enumerate(outputs):
        record = {
            "index": index,
            "num_prompt_tokens": out.num_prompt_tokens,
            "embedding": out.embedding.tolist(),
        }
        print(json.dumps(record))
    num_tokens = sum(out.num_prompt_tokens for out in outputs)
    print(
        f"{len(outputs)} embeddings of {num_tokens} prompt tokens in {elapsed:.2f} s",
        file=sys.stderr,
    )
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from mpengine.server.run import serve

    args.model_given = args.model is not _NONE or args.model_tag is not None
    if args.model_tag is not None:
        if args.model is not _NONE and args.model != args.model_tag:
            raise SystemExit(f"mpengine: two models: {args.model_tag!r} and --model {args.model!r}")
        args.model = args.model_tag
    return serve(args, config_from_args(args))


def cmd_stats(args: argparse.Namespace) -> int:
    from mpengine.client import Client
    from mpengine.runtime.timing import breakdown, counters

    check_address(args.address)
    token = auth_token_from_args(args)
    with Client(args.address, timeout=args.timeout, auth_token=token) as client:
        stats = client.stats()
    fields = {name: getattr(stats, name) for name in stats.__struct_fields__}
    # Each stage's totals as named counters, then what they mean per step.
    fields["stages"] = {stage: counters(times) for stage, times in stats.stages.items()}
    fields["per_step"] = breakdown(stats.stages)
    print(json.dumps(fields, indent=2))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mpengine",
        description="An LLM engine core whose scheduler, executor and output processor run as "
        "three OS processes.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="launch an engine, complete prompts, print them")
    gen.add_argument(
        "--prompt", action="append", help="a prompt (repeatable; default 'The quick brown fox')"
    )
    gen.add_argument("--stream", action="store_true", help="print text as it is generated")
    gen.add_argument("--json", action="store_true", help="print one JSON object per sample")
    add_sampling_args(gen)
    add_engine_args(gen)
    gen.set_defaults(func=cmd_generate)
    embed = sub.add_parser(
        "embed",
        help="launch an engine with an embedding model, embed texts, print one JSON object "
        "per text",
    )
    embed.add_argument("text", nargs="+", help="a text to embed")
    # How to pool is the engine's --pooling (the model's default, which requests keep).
    group = embed.add_argument_group("embedding")
    group.add_argument(
        "--normalize",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="L2-normalise the embeddings (default: the model's)",
    )
    group.add_argument(
        "--dimensions", type=int, default=None, help="keep the first N values (Matryoshka)"
    )
    group.add_argument(
        "--truncate-prompt-tokens",
        type=int,
        default=None,
        help="embed at most the first N tokens of each text (-1: as many as the model takes); "
        "by default a longer text is an error",
    )
    add_engine_args(embed)
    embed.set_defaults(func=cmd_embed)
    serve = sub.add_parser(
        "serve",
        help="run an engine with an OpenAI-compatible HTTP API until SIGTERM or SIGINT (then "
        "drain); IPC clients connect to its address too",
    )
    serve.add_argument(
        "model_tag",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="the model, as --model (vLLM's `vllm serve MODEL`)",
    )
    add_engine_args(serve)
    add_serve_args(serve)
    serve.set_defaults(func=cmd_serve)
    stacks = sub.add_parser("stacks", help="print every thread's stack of each engine process")
    add_stacks_args(stacks)
    stacks.set_defaults(func=cmd_stacks)
    top = sub.add_parser("top", help="a live view of a running engine (--once: one screen)")
    add_top_args(top)
    top.set_defaults(func=cmd_top)
    stats = sub.add_parser(
        "stats",
        help="print a running engine's counters as JSON: the scheduler's queues and blocks, "
        "each stage's time by phase and wait (stages), and per step (per_step: the executor's "
        "duty, each stage's ms per step, its waits on each ring and the lockstep counter)",
    )
    stats.add_argument("address", help="the engine's request address (ipc://... or tcp://...)")
    stats.add_argument(
        "--timeout",
        type=positive_float,
        default=10.0,
        help="seconds to wait for the engine (default: 10)",
    )
    stats.add_argument("--auth-token", default=None, help="the engine's auth token, if any")
    stats.add_argument("--auth-token-file", default=None, help=TOKEN_FILE_HELP)
    stats.set_defaults(func=cmd_stats)
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
    one_shot = args.command in ("generate", "embed")  # serve drains on SIGTERM by itself
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


if __name__ == "__main__":
    sys.exit(main())

"""``mpengine serve [MODEL]`` (the engine with its HTTP API, until SIGTERM) and ``mpengine
stats ADDR`` (a running engine's counters)."""

from __future__ import annotations

import argparse
import json

import mpengine.cli.vllm_flags as vllm_flags
from mpengine.cli.args import (
    add_engine_args,
    add_model_arg,
    add_running_engine_args,
    config_from_args,
    running_engine,
    take_model_tag,
)
from mpengine.server.options import add_serve_args, check_serve_args


def add_parsers(sub: argparse._SubParsersAction) -> None:
    serve = sub.add_parser(
        "serve",
        help="run an engine with an OpenAI-compatible HTTP API until SIGTERM or SIGINT (then "
        "drain); IPC clients connect to its address too",
    )
    add_model_arg(serve, "vLLM's `vllm serve MODEL`")
    add_engine_args(serve)
    add_serve_args(serve)
    serve.add_argument(
        "--headless",
        action="store_true",
        help="no HTTP API: the engine alone, for IPC clients and fronts elsewhere "
        "(--engine-address); or, with --nnodes and --node-rank above 0 (--master-addr, "
        "--master-port and the engine's flags as on node 0), only this host's "
        "tensor-parallel ranks of an engine whose node 0 runs elsewhere",
    )
    serve.add_argument(
        "--engine-address",
        action="append",
        default=[],
        metavar="ADDRESS",
        help="serve HTTP for an engine started elsewhere ('mpengine serve --headless "
        "--address tcp://HOST:PORT'), with the --auth-token-file it takes; repeated: "
        "data-parallel replicas this front routes requests between (one out of reach is "
        "reported and tried again, not fatal)",
    )
    vllm_flags.add_args(serve)
    serve.set_defaults(func=cmd_serve)
    stats = sub.add_parser(
        "stats",
        help="print a running engine's counters as JSON: the scheduler's queues and blocks, "
        "each stage's time by phase and wait (stages), and per step (per_step: the executor's "
        "duty, each stage's ms per step, its waits on each ring and the lockstep counter)",
    )
    add_running_engine_args(stats)
    stats.set_defaults(func=cmd_stats)


def cmd_serve(args: argparse.Namespace) -> int:
    from mpengine.server.run import serve

    take_model_tag(args)
    if args.headless:
        from mpengine.runtime.headless import run_headless
        from mpengine.runtime.stage import configure_logging

        config = config_from_args(args)
        configure_logging(config.log_level, "headless")
        return run_headless(config)
    vllm_flags.check(args)
    check_serve_args(args)
    return serve(args, config_from_args(args))


def cmd_stats(args: argparse.Namespace) -> int:
    from mpengine.runtime.timing import breakdown, counters

    with running_engine(args) as client:
        stats = client.stats()
    fields = {name: getattr(stats, name) for name in stats.__struct_fields__}
    # Each stage's totals as named counters, then what they mean per step.
    fields["stages"] = {stage: counters(times) for stage, times in stats.stages.items()}
    fields["per_step"] = breakdown(stats.stages)
    print(json.dumps(fields, indent=2))
    return 0

"""``mpengine top``: a live view of a running engine: requests, KV cache, rates, and each
stage's busy share with a verdict on which one limits the engine."""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass

from mpengine.cli.args import add_running_engine_args, positive_float, running_engine


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("top", help="a live view of a running engine (--once: one screen)")
    add_running_engine_args(parser)
    parser.add_argument(
        "--interval",
        type=positive_float,
        default=1.0,
        help="seconds between refreshes (default: 1)",
    )
    parser.add_argument("--once", action="store_true", help="print one screen and exit")
    parser.set_defaults(func=cmd_top)


def cmd_top(args: argparse.Namespace) -> int:
    """``mpengine top``: a live view, refreshed every ``--interval`` seconds."""
    with running_engine(args) as client:
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


@dataclass(slots=True)
class Sample:
    """One look at the engine: its stats, and when; of a data-parallel engine, each
    replica's too (None for one that did not answer)."""

    stats: object  # EngineStats
    at: float
    replicas: list | None = None


def take_sample(client) -> Sample:
    replicas = None
    if client.data_parallel_size > 1:
        replicas = []
        for rank in range(client.data_parallel_size):
            try:
                replicas.append(client.stats(timeout=2.0, data_parallel_rank=rank))
            except Exception:  # (out of reach, restarting: shown as such)
                replicas.append(None)
    return Sample(client.stats(), time.monotonic(), replicas)


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
        f"preemptions {s.preemptions} ({getattr(s, 'fair_preemptions', 0)} for fair shares)   "
        f"tenants {getattr(s, 'num_tenants', 0)}   "
        f"restarts: output {getattr(s, 'resyncs', 0)}, "
        f"executor {getattr(s, 'executor_restarts', 0)}",
        f"KV cache  {used:6.1%} of {s.num_blocks} blocks",
        f"rate      {generated:.1f} tokens/s generated   {computed:.1f} tokens/s computed   "
        f"{steps_per_s:.1f} steps/s   lockstep lag {s.step - s.done} steps",
    ]
    lines += _replica_lines(before, after, dt)
    lines += _stage_lines(getattr(p, "stages", {}), getattr(s, "stages", {}), dt)
    return "\n".join(lines)


def _replica_lines(before: Sample, after: Sample, dt: float) -> list[str]:
    """Each data-parallel replica's requests, KV cache and rate (its stages are the
    stage lines' ``STAGE dpN``)."""
    if after.replicas is None:
        return []
    lines = []
    for index, stats in enumerate(after.replicas):
        if stats is None:
            lines.append(f"replica {index}  not serving (no answer)")
            continue
        prev = before.replicas[index] if before.replicas else None
        generated = stats.generated_tokens - (prev.generated_tokens if prev else 0)
        used = 1.0 - stats.num_free_blocks / stats.num_blocks if stats.num_blocks else 0.0
        lines.append(
            f"replica {index}  {stats.num_running} running, "
            f"{stats.num_waiting + stats.num_preempted} waiting   KV cache {used:6.1%}   "
            f"{max(0, generated) / dt:.1f} tokens/s generated"
        )
    return lines


def _stage_lines(before: dict, after: dict, dt: float) -> list[str]:
    """Each stage's busy share of the interval and its ms per step, and the verdict."""
    if not after:
        return ["stages    (no step breakdown from this engine)"]
    width = max(10, *(len(stage) + 2 for stage in after))
    lines = [f"{'stage':<{width}}{'busy':>7}{'ms/step':>10}"]
    shares = {}
    for stage, times in after.items():
        prev = before.get(stage)
        busy = times.busy - (prev.busy if prev else 0.0)
        steps = times.steps - (prev.steps if prev else 0)
        shares[stage] = busy / dt
        per_step = f"{1000 * busy / steps:.2f}" if steps else "-"
        lines.append(f"{stage:<{width}}{shares[stage]:>7.0%}{per_step:>10}")
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

"""Soak: minutes of mixed load on one engine, watching for leaks.

Each round submits ``--requests`` requests at once (mixed lengths, sampling, logprobs, stop
strings, ``n > 1``) plus a few the engine must reject, aborts some mid-stream, waits for the
engine to go idle, then prints each stage's private resident memory (``RssAnon``), its
shared-memory pages (``RssShmem``: the rings' pages count once touched, so this grows until
each ring's cursor has wrapped once, up to ``ring_bytes`` per ring) and the free KV blocks.
Exits non-zero if blocks are missing after any round, or if a stage's private memory grew
by more than ``--max-growth-mib`` between the second round and the last.

    python tools/soak.py --minutes 10 --requests 200
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import sys
import time
from collections import Counter

import mpengine
from mpengine import SamplingParams
from mpengine.testing.engine import wait_idle


def rss_mib(pid: int, field: str = "VmRSS") -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return 0.0


def one_round(
    client: mpengine.Client, rng: random.Random, num_requests: int, outcomes: Counter
) -> None:
    prompts, params = [], []
    for i in range(num_requests):
        prompts.append(f"soak {i} " * rng.randint(1, 40))
        params.append(
            SamplingParams(
                max_tokens=rng.randint(1, 48),
                temperature=rng.choice([0.0, 0.7, 1.0]),
                top_p=rng.choice([1.0, 0.9]),
                seed=rng.choice([None, rng.randrange(1000)]),
                n=rng.choice([1, 1, 1, 2]),
                logprobs=rng.choice([None, None, 3]),
                stop=rng.choice([[], ["the"], ["zz", "q"]]),
            )
        )
    streams = [client.stream("abort me " * 5, SamplingParams(max_tokens=500)) for _ in range(4)]
    for stream in streams:
        next(stream)  # running now; closing the generator aborts the request
    for out in client.generate_many(prompts, params, timeout=300):
        for sample in out.outputs:
            outcomes[sample.finish_reason] += 1
    for stream in streams:
        stream.close()
        outcomes["abort (client)"] += 1
    # Requests the engine must reject, each alone: the rest goes on.
    for bad in ([5] * 200, SamplingParams(max_tokens=4000, min_tokens=4000)), ([10**7], None):
        try:
            client.generate(*bad, timeout=30)
        except mpengine.InvalidRequestError:
            outcomes["rejected"] += 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--runtime", default="processes", choices=["processes", "serial"])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--minutes", type=float, default=None, help="run this long instead")
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--kv-cache-bytes", type=int, default=64 << 20)
    parser.add_argument("--max-growth-mib", type=float, default=16.0)
    parser.add_argument("--json", default="soak.json")
    args = parser.parse_args()

    rng = random.Random(0)
    history: list[dict] = []
    engine = mpengine.launch(
        model=args.model,
        runtime=args.runtime,
        kv_cache_bytes=args.kv_cache_bytes,
        log_level="WARNING",
    )
    failed = False
    outcomes: Counter = Counter()
    began = time.monotonic()
    with engine, engine.client() as client:
        for round_index in itertools.count():
            if args.minutes is not None:
                if time.monotonic() - began > args.minutes * 60:
                    break
            elif round_index >= args.rounds:
                break
            start = time.perf_counter()
            one_round(client, rng, args.requests, outcomes)
            stats = wait_idle(client, timeout=30.0)
            row = {
                "round": round_index,
                "seconds": time.perf_counter() - start,
                "free_blocks": stats.num_free_blocks,
                "num_blocks": stats.num_blocks,
                "finished": stats.finished,
                "rss_mib": {name: rss_mib(pid) for name, pid in engine.pids.items()},
                "anon_mib": {name: rss_mib(pid, "RssAnon") for name, pid in engine.pids.items()},
                "shmem_mib": {name: rss_mib(pid, "RssShmem") for name, pid in engine.pids.items()},
                "client_rss_mib": rss_mib(os.getpid()),
            }
            history.append(row)
            rss = " ".join(
                f"{k} {v:6.1f}+{row['shmem_mib'][k]:4.1f}" for k, v in row["anon_mib"].items()
            )
            print(
                f"round {round_index:3d} {row['seconds']:6.2f} s  free "
                f"{stats.num_free_blocks}/{stats.num_blocks}  private+shm MiB: {rss}",
                flush=True,
            )
            if stats.num_free_blocks != stats.num_blocks:
                print("KV blocks were not all freed", file=sys.stderr)
                failed = True
    finished = history[-1]["finished"] if history else 0
    print(
        f"engine requests finished: {finished}; outcomes seen by the clients (one per sample, "
        f"or per refused request): {dict(outcomes)}"
    )
    if len(history) > 2:
        for name, last in history[-1]["anon_mib"].items():
            first = history[1]["anon_mib"][name]
            growth = last - first
            shm = (history[1]["shmem_mib"][name], history[-1]["shmem_mib"][name])
            print(
                f"{name}: private {first:.1f} -> {last:.1f} MiB ({growth:+.1f}) from round 1 to "
                f"round {len(history) - 1}; ring pages {shm[0]:.1f} -> {shm[1]:.1f} MiB"
            )
            failed |= growth > args.max_growth_mib
    with open(args.json, "w") as f:
        json.dump({"history": history, "outcomes": dict(outcomes)}, f, indent=2)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()

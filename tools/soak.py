"""Soak: minutes of mixed load on one engine, watching for leaks.

Each round submits ``--requests`` requests at once (mixed lengths, sampling, logprobs, stop
strings, ``n > 1``), aborts some mid-stream, waits for the engine to go idle, then prints
each stage's resident memory and the free KV blocks. Exits non-zero if blocks are missing
after any round, or if a stage's memory grew by more than ``--max-growth-mib`` between the
second round and the last.

    python tools/soak.py --rounds 30 --requests 400
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

import mpengine
from mpengine import SamplingParams
from mpengine.testing.engine import wait_idle


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def one_round(client: mpengine.Client, rng: random.Random, num_requests: int) -> None:
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
    client.generate_many(prompts, params)
    for stream in streams:
        stream.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--runtime", default="processes", choices=["processes", "serial"])
    parser.add_argument("--rounds", type=int, default=30)
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
    with engine, engine.client() as client:
        for round_index in range(args.rounds):
            start = time.perf_counter()
            one_round(client, rng, args.requests)
            stats = wait_idle(client, timeout=30.0)
            row = {
                "round": round_index,
                "seconds": time.perf_counter() - start,
                "free_blocks": stats.num_free_blocks,
                "num_blocks": stats.num_blocks,
                "rss_mib": {name: rss_mib(pid) for name, pid in engine.pids.items()},
                "client_rss_mib": rss_mib(os.getpid()),
            }
            history.append(row)
            rss = " ".join(f"{k} {v:6.1f}" for k, v in row["rss_mib"].items())
            print(
                f"round {round_index:3d} {row['seconds']:6.2f} s  free "
                f"{stats.num_free_blocks}/{stats.num_blocks}  RSS MiB: {rss}",
                flush=True,
            )
            if stats.num_free_blocks != stats.num_blocks:
                print("KV blocks were not all freed", file=sys.stderr)
                failed = True
    if len(history) > 2:
        for name, last in history[-1]["rss_mib"].items():
            growth = last - history[1]["rss_mib"][name]
            print(f"{name}: {growth:+.1f} MiB from round 1 to round {len(history) - 1}")
            failed |= growth > args.max_growth_mib
    with open(args.json, "w") as f:
        json.dump(history, f, indent=2)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()

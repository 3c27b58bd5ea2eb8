"""Offline generation throughput: the processes runtime against the serial baseline.

For each model: launch one engine per runtime, warm them up, then time ``--repeats``
rounds, each running ``--num-requests`` prompts x ``--max-tokens`` tokens (ignore_eos, so
every run generates the same number of tokens) on every engine in turn; report the median
tokens/s and the ratio to the serial runtime measured in the same invocation. Prints a
table, writes JSON.

    python tools/bench_engine.py --models tiny small --json bench_engine.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import mpengine
from mpengine.protocol import SamplingParams

CONFIGS = {
    "serial": {"runtime": "serial", "async_depth": 0},
    "processes-depth0": {"runtime": "processes", "async_depth": 0},
    "processes-depth1": {"runtime": "processes", "async_depth": 1},
}


def prompts(n: int) -> list[str]:
    topics = ["the sea", "a city at night", "old machines", "mountain weather", "a library"]
    return [f"Request {i}: write a few lines about {topics[i % len(topics)]}." for i in range(n)]


def run_model(model: str, args: argparse.Namespace) -> list[dict]:
    """Every runtime of one model, launched together and timed in interleaved rounds, so
    drifts of a shared machine hit them alike (an idle engine costs ~1% of a core)."""
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=0.0,
        ignore_eos=True,
        logprobs=args.logprobs,
        stop=args.stop,
    )
    batch = prompts(args.num_requests)
    num_tokens = len(batch) * args.max_tokens
    engines = {
        name: mpengine.launch(model=model, **CONFIGS[name], **args.engine) for name in args.runtimes
    }
    clients = {name: engine.client() for name, engine in engines.items()}
    times: dict[str, list[float]] = {name: [] for name in engines}
    try:
        for client in clients.values():
            client.generate_many(batch[:8], SamplingParams(max_tokens=8, ignore_eos=True))
        for _ in range(args.repeats):
            for name, client in clients.items():
                start = time.perf_counter()
                outs = client.generate_many(batch, params)
                times[name].append(time.perf_counter() - start)
                assert sum(len(o.token_ids) for o in outs) == num_tokens, (
                    "a stop string matched: every run must generate the same number of tokens"
                )
        steps = {name: client.stats().step for name, client in clients.items()}
    finally:
        for name in engines:
            clients[name].close()
            engines[name].shutdown()
    rows = []
    for name, engine in engines.items():
        median = statistics.median(times[name])
        rows.append(
            {
                "model": model,
                "runtime": name,
                "num_threads": engine.config.num_threads,
                "seconds": times[name],
                "median_seconds": median,
                "tokens_per_s": num_tokens / median,
                "steps_per_run": steps[name] / (args.repeats + 1),
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["tiny", "small"])
    parser.add_argument("--runtimes", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5, help="interleaved timed rounds")
    parser.add_argument(
        "--logprobs",
        type=int,
        default=None,
        help="top-N logprobs per token (output-processing heavy)",
    )
    parser.add_argument(
        "--stop",
        action="append",
        default=[],
        help="a stop string that never matches (output-processing heavy)",
    )
    parser.add_argument(
        "--num-threads",
        type=int,
        default=None,
        help="executor torch threads (default: the engine's choice per runtime)",
    )
    parser.add_argument("--json", default="bench_engine.json")
    args = parser.parse_args()
    args.engine = {"num_threads": args.num_threads} if args.num_threads else {}

    rows = []
    for model in args.models:
        for row in run_model(model, args):
            rows.append(row)
            print(f"  {model:6} {row['runtime']:18} {row['tokens_per_s']:9.1f} tok/s", flush=True)
    baseline = {r["model"]: r["tokens_per_s"] for r in rows if r["runtime"] == "serial"}
    print()
    print(f"{'model':8}{'runtime':20}{'threads':>8}{'median s':>10}{'tok/s':>10}{'vs serial':>11}")
    for r in rows:
        ratio = r["tokens_per_s"] / baseline[r["model"]] if r["model"] in baseline else float("nan")
        r["ratio_vs_serial"] = ratio
        print(
            f"{r['model']:8}{r['runtime']:20}{r['num_threads']:>8}{r['median_seconds']:>10.2f}"
            f"{r['tokens_per_s']:>10.1f}{ratio:>10.2f}x"
        )
    with open(args.json, "w") as f:
        json.dump(
            {
                "num_requests": args.num_requests,
                "max_tokens": args.max_tokens,
                "repeats": args.repeats,
                "results": rows,
            },
            f,
            indent=2,
        )
    print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()

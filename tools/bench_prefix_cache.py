"""Prefix caching: a shared system prompt and short questions, with and without the cache.

64 concurrent requests per round, each a 1,000-token system prompt followed by a short
question, ``--max-tokens`` greedy tokens each. Two engines (``prefix_caching`` on and off)
run at once and are timed in interleaved rounds, so a shared machine's drifts hit both
alike. A third row takes the caching engine cold: each round a system prompt it has never
seen, which the burst's requests share as soon as the first of them computes it. Reports
time to first token (median over all requests of the timed rounds) and output tokens/s
(median over rounds), as a table and JSON.

    python tools/bench_prefix_cache.py --rounds 5
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import mpengine
from mpengine import SamplingParams
from mpengine.testing.bench import Report, engine_record, gpu_share, percentile, stop_on_sigterm


def run_round(
    client: mpengine.Client, system: list[int], rng: random.Random, args: argparse.Namespace
) -> tuple[float, list[float]]:
    """Output tokens/s of one round and each request's time to first token."""
    vocab = client.info.vocab_size
    prompts = [
        system + [rng.randrange(3, vocab) for _ in range(20)] for _ in range(args.concurrency)
    ]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    outs = client.generate_many(prompts, params, timeout=900)
    elapsed = time.perf_counter() - start
    ttft = [o.metrics.first_token_time - o.metrics.arrival_time for o in outs]
    return sum(len(o.token_ids) for o in outs) / elapsed, ttft


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--system-tokens", type=int, default=1000)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=None,
        help="each engine's share of the GPU (default on CUDA: 0.85 split between the two)",
    )
    parser.add_argument("--json", default="bench_prefix_cache.json")
    args = parser.parse_args()
    stop_on_sigterm()
    report = Report(args.json, args)
    options: dict[str, object] = {"device": args.device}
    share = args.gpu_memory_utilization or gpu_share(args.device, 2, hf_row=False)
    if share is not None:
        options["gpu_memory_utilization"] = share

    engines = {
        caching: mpengine.launch(
            model=args.model,
            prefix_caching=caching,
            max_num_seqs=args.concurrency,
            log_level="WARNING",
            **options,
        )
        for caching in (True, False)
    }
    clients = {caching: engine.client() for caching, engine in engines.items()}
    rows = ("caching", "no caching", "caching, cold")
    rates: dict[str, list[float]] = {name: [] for name in rows}
    ttfts: dict[str, list[float]] = {name: [] for name in rows}
    try:
        vocab = clients[True].info.vocab_size
        system = [random.Random(0).randrange(3, vocab) for _ in range(args.system_tokens)]
        for client in clients.values():  # warm-up (and, with caching, fill it)
            run_round(client, system, random.Random(1), args)
        for round_index in range(args.rounds):
            cold = [random.Random(100 + round_index).randrange(3, vocab) for _ in system]
            for name, client, prompt in (
                ("caching", clients[True], system),
                ("no caching", clients[False], system),
                ("caching, cold", clients[True], cold),
            ):
                rate, ttft = run_round(client, prompt, random.Random(10 + round_index), args)
                rates[name].append(rate)
                ttfts[name] += ttft
            print(
                f"round {round_index}: "
                + ", ".join(f"{name} {rates[name][-1]:7.0f} tok/s" for name in rows),
                flush=True,
            )
            report.update(tokens_per_s=rates, ttft_s=ttfts)
        hits = clients[True].stats()
        report.update(engines={str(k): engine_record(e) for k, e in engines.items()})
    finally:
        for client in clients.values():
            client.close()
        for engine in engines.values():
            engine.shutdown()

    def row(name: str) -> tuple[float, float, float]:
        ttft = sorted(ttfts[name])
        return (
            statistics.median(rates[name]),
            1000 * statistics.median(ttft),
            1000 * percentile(ttft, 0.99),
        )

    on, off, cold = row("caching"), row("no caching"), row("caching, cold")
    print(
        f"\n| {args.concurrency} x ({args.system_tokens}-token system prompt + 20-token "
        f"question), {args.max_tokens} tokens each | tokens/s | TTFT p50 ms | TTFT p99 ms |"
    )
    print("|---|---|---|---|")
    print(f"| no prefix caching | {off[0]:.0f} | {off[1]:.0f} | {off[2]:.0f} |")
    print(f"| prefix caching | {on[0]:.0f} | {on[1]:.0f} | {on[2]:.0f} |")
    print(
        f"| prefix caching, a new system prompt | {cold[0]:.0f} | {cold[1]:.0f} | {cold[2]:.0f} |"
    )
    print(
        f"\nthroughput {on[0] / off[0]:.2f}x, TTFT p50 {off[1] / on[1]:.1f}x lower; cold "
        f"{cold[0] / off[0]:.2f}x and {off[1] / cold[1]:.1f}x; cache hit rate "
        f"{hits.prefix_cache_hits / max(1, hits.prefix_cache_queries):.1%}"
    )
    report.finish(
        tokens_per_s=rates,
        ttft_s=ttfts,
        prefix_cache_queries=hits.prefix_cache_queries,
        prefix_cache_hits=hits.prefix_cache_hits,
    )


if __name__ == "__main__":
    main()

"""A preemption storm: a KV cache sized for a third of the working set, recompute vs swap.

``--concurrency`` requests per round, each a ``--prompt-tokens`` prompt generating
``--max-tokens`` greedy tokens; the KV cache holds a third of what they need at their
longest, so running sequences are preempted again and again. Two engines (preemption by
recompute and by swap) run at once and are timed in interleaved rounds, so a shared
machine's drifts hit both alike. Reports output tokens/s (median over rounds) and the
preemptions and swapped blocks per round, as a table and JSON.

    python tools/bench_preemption.py --model small --rounds 3
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import mpengine
from mpengine import SamplingParams


def run_round(client: mpengine.Client, seed: int, args: argparse.Namespace) -> dict[str, float]:
    vocab = client.info.vocab_size
    rng = random.Random(seed)
    prompts = [
        [rng.randrange(3, vocab) for _ in range(args.prompt_tokens)]
        for _ in range(args.concurrency)
    ]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    before = client.stats()
    start = time.perf_counter()
    outs = client.generate_many(prompts, params, timeout=1800)
    elapsed = time.perf_counter() - start
    after = client.stats()
    return {
        "tokens_per_s": sum(len(o.token_ids) for o in outs) / elapsed,
        "preemptions": after.preemptions - before.preemptions,
        "swapped_out_blocks": after.swapped_out_blocks - before.swapped_out_blocks,
        "computed_tokens": after.computed_tokens - before.computed_tokens,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--json", default="bench_preemption.json")
    args = parser.parse_args()

    per_seq = -(-(args.prompt_tokens + args.max_tokens) // args.block_size)
    num_blocks = max(per_seq + 1, args.concurrency * per_seq // 3)
    engines = {
        mode: mpengine.launch(
            model=args.model,
            preemption_mode=mode,
            num_gpu_blocks_override=num_blocks,
            block_size=args.block_size,
            max_num_seqs=args.concurrency,
            prefix_caching=False,  # a recomputed prompt must not come back from the cache
            log_level="WARNING",
        )
        for mode in ("recompute", "swap")
    }
    clients = {mode: engine.client() for mode, engine in engines.items()}
    rounds: dict[str, list[dict[str, float]]] = {mode: [] for mode in engines}
    try:
        for client in clients.values():  # warm-up
            run_round(client, 0, argparse.Namespace(**{**vars(args), "concurrency": 2}))
        for index in range(args.rounds):
            for mode, client in clients.items():
                rounds[mode].append(run_round(client, 1 + index, args))
            summary = ", ".join(
                f"{mode} {r[-1]['tokens_per_s']:.0f} tok/s ({r[-1]['preemptions']:.0f} preemptions)"
                for mode, r in rounds.items()
            )
            print(f"round {index}: {summary}", flush=True)
    finally:
        for client in clients.values():
            client.close()
        for engine in engines.values():
            engine.shutdown()

    def median(mode: str, key: str) -> float:
        return statistics.median(r[key] for r in rounds[mode])

    print(
        f"\n| {args.model}: {args.concurrency} x ({args.prompt_tokens} + {args.max_tokens} "
        f"tokens), KV cache {num_blocks} blocks (a third of the working set) | tokens/s | "
        "preemptions | swapped-out blocks | tokens computed |"
    )
    print("|---|---|---|---|---|")
    for mode in engines:
        print(
            f"| {mode} | {median(mode, 'tokens_per_s'):.0f} | {median(mode, 'preemptions'):.0f} "
            f"| {median(mode, 'swapped_out_blocks'):.0f} | {median(mode, 'computed_tokens'):.0f} |"
        )
    ratio = median("swap", "tokens_per_s") / median("recompute", "tokens_per_s")
    print(f"\nswap / recompute throughput: {ratio:.2f}x")
    with open(args.json, "w") as f:
        json.dump({"args": vars(args), "num_blocks": num_blocks, "rounds": rounds}, f, indent=2)


if __name__ == "__main__":
    main()

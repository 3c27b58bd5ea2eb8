"""Beam search against sampling with as many samples: the cost per step of the search.

One engine; ``--requests`` prompts of ``--prompt-tokens``, each generating ``--max-tokens``
tokens either with beam search of width ``--width`` (``min_tokens``-free, EOS ignored so
every beam runs to the end) or sampling ``n = width`` (same lengths). Rounds alternate the
two modes. Reports, per mode (medians over rounds): output tokens/s counting every beam or
sample, engine steps, and wall time per step; the beam step's overhead is the ratio of the
per-step times. A beam group waits for its step to be decided before its next one is
planned, so under ``async_depth=1`` it also takes more steps.

    python tools/bench_beam.py --width 4 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import mpengine
from mpengine import SamplingParams


def run(client: mpengine.Client, params: SamplingParams, prompts: list[list[int]]) -> dict:
    before = client.stats()
    start = time.perf_counter()
    outs = client.generate_many(prompts, params, timeout=1800)
    elapsed = time.perf_counter() - start
    after = client.stats()
    steps = after.step - before.step
    tokens = after.generated_tokens - before.generated_tokens
    assert all(o.finished for o in outs)
    return {
        "seconds": elapsed,
        "steps": steps,
        "tokens": tokens,
        "ms_per_step": 1e3 * elapsed / steps,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--width", type=int, default=4)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", default="bench_beam.json")
    args = parser.parse_args()

    rng = random.Random(0)
    modes = {
        "beam search": SamplingParams(
            max_tokens=args.max_tokens,
            use_beam_search=True,
            beam_width=args.width,
            n=args.width,
            ignore_eos=True,
            early_stopping="never",
        ),
        f"sampling n={args.width}": SamplingParams(
            max_tokens=args.max_tokens, n=args.width, temperature=1.0, seed=1, ignore_eos=True
        ),
    }
    results: dict[str, list[dict]] = {mode: [] for mode in modes}
    with mpengine.launch(
        model=args.model, max_num_seqs=args.requests * args.width, log_level="WARNING"
    ) as engine:
        client = engine.client(timeout=600)
        vocab = client.info.vocab_size
        prompts = [
            [rng.randrange(3, vocab) for _ in range(args.prompt_tokens)]
            for _ in range(args.requests)
        ]
        for params in modes.values():  # warm-up
            client.generate_many(prompts[:2], params, timeout=600)
        for index in range(args.rounds):
            for mode, params in modes.items():
                results[mode].append(run(client, params, prompts))
            print(
                f"round {index}: "
                + ", ".join(
                    f"{mode} {r[-1]['ms_per_step']:.1f} ms/step" for mode, r in results.items()
                ),
                flush=True,
            )

    def median(mode: str, key: str) -> float:
        return statistics.median(r[key] for r in results[mode])

    print(
        f"\n| {args.model}, {args.requests} x ({args.prompt_tokens} + {args.max_tokens} tokens), "
        f"width {args.width} | tokens/s | steps | ms/step |"
    )
    print("|---|---|---|---|")
    for mode in modes:
        rate = statistics.median(r["tokens"] / r["seconds"] for r in results[mode])
        steps, per_step = median(mode, "steps"), median(mode, "ms_per_step")
        print(f"| {mode} | {rate:.0f} | {steps:.0f} | {per_step:.2f} |")
    beam, sample = modes
    overhead = median(beam, "ms_per_step") / median(sample, "ms_per_step") - 1
    print(f"\nbeam step overhead over sampling: {overhead:+.0%}")
    with open(args.json, "w") as f:
        json.dump({"args": vars(args), "results": results}, f, indent=2)


if __name__ == "__main__":
    main()

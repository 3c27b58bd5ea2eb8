"""Micro-benchmark of ``OutputProcessor.process``: one step for many decoding sequences.

    python tools/bench_output.py [--seqs 256] [--steps 200] [--stop] [--logprobs 5]

Tokens come from the bundled multilingual corpus (so the detokenizer meets split
multi-byte characters), each sequence reading from its own offset. Prints the mean,
median and p99 time per step and per sequence.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from mpengine.models.tiny_tokenizer import QWEN3_TOKENIZER, corpus_texts, write_tokenizer
from mpengine.output import OutputProcessor
from mpengine.protocol import Array, Logprobs, NewRequest, SamplingParams, StepResult


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, default=256)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--stop", action="store_true", help="give every request 2 stop strings")
    parser.add_argument("--logprobs", type=int, default=None, help="top-N logprobs per token")
    args = parser.parse_args()
    if args.seqs < 1 or args.steps < 1:
        parser.error("--seqs and --steps must be at least 1")

    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = write_tokenizer(QWEN3_TOKENIZER, Path(tmp))
        processor = OutputProcessor(tmp, [tokenizer.token_to_id("<|im_end|>")])
    corpus = tokenizer.encode("\n".join(corpus_texts())).ids
    corpus = [t for t in corpus if t not in processor.eos_token_ids]

    sampling = SamplingParams(
        max_tokens=args.steps + 1,
        stop=["<<END>>", "\n\n\n"] if args.stop else [],
        logprobs=args.logprobs,
    )
    for i in range(args.seqs):
        processor.announce(
            NewRequest(f"r{i}", "client", [i], 16, sampling, None, time.time(), time.time())
        )

    seq_ids = Array.of(np.arange(args.seqs), "int64")
    rng = np.random.default_rng(0)
    offsets = rng.integers(0, len(corpus) - args.steps, size=args.seqs)
    stream = np.asarray(corpus, dtype=np.int32)
    logprobs = None
    if args.logprobs is not None:
        n = args.seqs
        logprobs = Logprobs(
            Array.of(np.zeros(n), "int32"),
            Array.of(np.zeros(n), "float32"),
            Array.of(np.zeros((n, args.logprobs)), "int32"),
            Array.of(np.zeros((n, args.logprobs)), "float32"),
        )
    results = [
        StepResult(
            step,
            seq_ids,
            Array.of(stream[offsets + step], "int32"),
            logprobs=logprobs,
            logprob_rows=Array.of(np.arange(args.seqs)) if logprobs else Array.of([]),
        )
        for step in range(args.steps)
    ]

    # Wall time, and the thread's CPU time (steadier on a machine shared with other work).
    walls: list[float] = []
    cpus: list[float] = []
    num_chars = 0
    for result in results:
        wall, cpu = time.perf_counter(), time.thread_time()
        _, outputs = processor.process(result)
        cpus.append(time.thread_time() - cpu)
        walls.append(time.perf_counter() - wall)
        num_chars += sum(len(delta.text) for _, delta in outputs)
    print(
        f"{args.seqs} seqs x {args.steps} steps (stop={args.stop}, logprobs={args.logprobs}), "
        f"{num_chars} chars streamed"
    )
    for name, times in (("wall", walls), ("cpu", cpus)):
        times.sort()
        mean = statistics.fmean(times)
        print(
            f"  {name}: mean {mean * 1e3:.3f} ms, median {times[len(times) // 2] * 1e3:.3f} ms,"
            f" p99 {times[int(len(times) * 0.99)] * 1e3:.3f} ms per step;"
            f" {mean / args.seqs * 1e6:.2f} us per sequence"
        )


if __name__ == "__main__":
    main()

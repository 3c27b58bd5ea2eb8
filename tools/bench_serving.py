"""Serving load: one workload through the HTTP API and through the IPC client library.

Starts ``mpengine serve`` (loopback, a free port, an ipc address of its own) and sends the
same requests, in the same order, three ways, all bounded in count and time:

- ``ipc``: ``mpengine.AsyncClient`` streams at a fixed concurrency;
- ``http``: streaming ``/v1/completions`` at the same concurrency, from a small asyncio
  HTTP/1.1 client (one keep-alive connection per concurrent client, so the client's own
  cost stays out of the figures as far as possible);
- ``http-poisson``: open-loop Poisson arrivals at fractions of the measured HTTP capacity,
  on an absolute schedule: latencies count from when a request was due, so a load that
  makes the client or the server fall behind shows in them (no coordinated omission);
- ``hf-static``: transformers' ``generate`` on static batches of the concurrency, on the
  engine's device and dtype (each batch runs until its longest output is done; only the
  asked-for tokens count; every request is there from the start).

Prompt lengths and output lengths are drawn (seeded) from uniform distributions; outputs
ignore EOS, so every mode produces the same tokens. The ``ipc`` and ``http`` runs
alternate for ``--rounds`` rounds (which goes first alternates too), so a shared machine's
drifts hit both alike; the table shows medians over rounds. Per mode: requests/s, generated
tokens/s, time to first token, time per output token (per request) and the gaps between
received outputs (p50, p99, measured by the client), failed requests (counted, not fatal),
preemptions (the engine's counter), and this process's CPU use (a load generator near one
core measures itself). At the end: the HTTP layer's added TTFT (http minus ipc, p50 and
p99) and the ratio of their throughputs. The JSON is rewritten after every round.

    python tools/bench_serving.py --model tiny --concurrency 64 --requests 256

``-dp 1 2``: all of it with one engine, then with two data-parallel replicas behind the
same front (``mpengine serve --data-parallel-size 2``; on the CPU each replica's executor
takes its share of the cores), rows named ``ipc dp1``, ``http dp2``...; at the end each
size's tokens/s over the first size's:

    python tools/bench_serving.py --model small -dp 1 2 --concurrency 32 --requests 64 --no-hf

``--chat``: every request is a conversation instead (one user message: a question from a
fixed list after seeded filler words, as many as bring the prompt the chat template renders
to the drawn --prompt-min..--prompt-max tokens, as near as the template's own tokens allow).
``ipc`` sends it with ``AsyncClient.chat_stream`` (the template rendered in the client),
``http`` and ``http-poisson`` as streaming ``/v1/chat/completions`` (rendered in the server;
tokens counted from each chunk's ``token_ids``); both render inside the measured TTFT.
``hf-static`` renders the same conversations with transformers' ``apply_chat_template``.
Outputs still ignore EOS, with the same drawn max_tokens, so the modes' tokens match:

    python tools/bench_serving.py --model smollm2-135m --chat --concurrency 16 --requests 32 \\
        --rounds 2 --no-hf
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import select
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import mpengine
from mpengine import SamplingParams
from mpengine.testing.bench import Report, percentile, stop_on_sigterm


@dataclass
class Request:
    prompt_ids: list[int]  # with --chat: the conversation as the engine's template renders it
    max_tokens: int
    messages: list[dict[str, str]] | None = None  # --chat: the conversation sent


@dataclass
class Timing:
    """What the client saw of one request (seconds, ``time.perf_counter``). ``due`` is when
    it was meant to be sent: latencies count from then, so a client (or server) that falls
    behind an open-loop schedule shows it (no coordinated omission)."""

    sent: float
    first: float = 0.0
    last: float = 0.0
    num_tokens: int = 0
    gaps: list[float] = field(default_factory=list)
    due: float | None = None
    error: str | None = None

    @property
    def start(self) -> float:
        return self.sent if self.due is None else self.due

    def token(self, now: float, count: int) -> None:
        if count <= 0:
            return
        if self.num_tokens == 0:
            self.first = now
        else:
            self.gaps.append(now - self.last)
        self.last = now
        self.num_tokens += count


@dataclass
class Result:
    mode: str
    load: str  # "C=64" or "12.0 req/s"
    requests: int
    seconds: float
    requests_per_s: float
    tokens_per_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    itl_p50_ms: float  # between the outputs a client received (several tokens may share one)
    itl_p99_ms: float
    preemptions: int
    tpot_p50_ms: float = math.nan  # per request: (last token - first) / (tokens - 1)
    tpot_p99_ms: float = math.nan
    failed: int = 0  # requests that ended in an error (counted, not fatal)
    client_cpu: float = 0.0  # this process's CPU seconds per wall second (1.0: a core)
    send_lag_ms: float = 0.0  # open loop: mean delay of sends behind their schedule


def workload(args: argparse.Namespace, vocab_size: int) -> list[Request]:
    rng = random.Random(args.seed)
    requests = []
    for _ in range(args.requests):
        prompt_len = rng.randint(args.prompt_min, args.prompt_max)
        prompt = [rng.randrange(100, vocab_size) for _ in range(prompt_len)]
        requests.append(Request(prompt, rng.randint(args.output_min, args.output_max)))
    return requests


# --chat: each conversation is one of these questions after filler words, both drawn (seeded).
QUESTIONS = (
    "Summarize the notes above in three sentences.",
    "What is the main idea of the text above?",
    "Which of the words above appear most often, and why might that be?",
    "Write a short poem inspired by the words above.",
    "Explain the text above to a ten-year-old.",
    "List five questions a reader might ask about the notes above.",
    "Turn the notes above into a short story with a happy ending.",
    "What would be a good title for the text above?",
    "Translate the general mood of the notes above into a single paragraph.",
    "Give three arguments for and three against the ideas above.",
    "Rewrite the notes above as a formal email to a colleague.",
    "Which topics from the text above would make a good lecture series?",
)
_WORDS = (
    "time year people way day man thing woman life child world school state family student "
    "group country problem hand part place case week company system program question work "
    "government number night point home water room mother area money story fact month lot "
    "right study book eye job word business issue side kind head house service friend father "
    "power hour game line end member law car city community name president team minute idea "
    "kid body information back parent face others level office door health person art war "
    "history party result change morning reason research girl guy moment air teacher force "
    "education river mountain garden music light energy market village bridge window paper "
    "quickly slowly carefully green blue bright quiet ancient modern simple strange"
)
WORDS = _WORDS.split()


def conversation(question: str, filler: list[str]) -> list[dict[str, str]]:
    """One user message: the filler words as notes, then the question."""
    notes = f"Notes: {' '.join(filler)}.\n\n" if filler else ""
    return [{"role": "user", "content": notes + question}]


def chat_workload(
    args: argparse.Namespace, render: Callable[[list[dict[str, str]]], list[int]]
) -> list[Request]:
    """Seeded conversations whose rendered prompts (``render``: a conversation's token ids
    through the chat template) have about the drawn lengths: the most filler words that keep
    it within the drawn length (never under the question alone, whose length the template's
    own tokens bound from below)."""
    rng = random.Random(args.seed)
    requests = []
    for _ in range(args.requests):
        target = rng.randint(args.prompt_min, args.prompt_max)
        max_tokens = rng.randint(args.output_min, args.output_max)
        question = rng.choice(QUESTIONS)
        filler = [rng.choice(WORDS) for _ in range(target)]  # a word takes a token at least
        low, high = 0, target  # the most words that fit: binary search
        while low < high:
            middle = (low + high + 1) // 2
            if len(render(conversation(question, filler[:middle]))) <= target:
                low = middle
            else:
                high = middle - 1
        messages = conversation(question, filler[:low])
        requests.append(Request(render(messages), max_tokens, messages))
    return requests


def engine_chat_workload(args: argparse.Namespace, address: str) -> list[Request]:
    """``chat_workload`` rendered by the engine's own template and tokenizer (as
    ``chat_stream`` and the HTTP server render it)."""
    with mpengine.Client(address) as client:
        return chat_workload(args, client.apply_chat_template)


def _nan_to_none(value: Any) -> Any:
    if isinstance(value, float) and value != value:
        return None
    if isinstance(value, dict):
        return {k: _nan_to_none(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_nan_to_none(v) for v in value]
    return value


def summarize(
    mode: str,
    load: str,
    timings: list[Timing],
    seconds: float,
    preemptions: int,
    client_cpu: float = 0.0,
) -> Result:
    done = [t for t in timings if t.num_tokens and t.error is None]
    ttfts = [1000 * (t.first - t.start) for t in done]
    gaps = [1000 * g for t in done for g in t.gaps]
    tpots = [1000 * (t.last - t.first) / (t.num_tokens - 1) for t in done if t.num_tokens > 1]
    lags = [1000 * (t.sent - t.due) for t in timings if t.due is not None and t.sent]
    tokens = sum(t.num_tokens for t in done)
    return Result(
        mode,
        load,
        len(done),
        seconds,
        len(done) / seconds,
        tokens / seconds,
        percentile(ttfts, 0.5),
        percentile(ttfts, 0.99),
        percentile(gaps, 0.5),
        percentile(gaps, 0.99),
        preemptions,
        tpot_p50_ms=percentile(tpots, 0.5),
        tpot_p99_ms=percentile(tpots, 0.99),
        failed=sum(t.error is not None for t in timings),
        client_cpu=client_cpu,
        send_lag_ms=statistics.fmean(lags) if lags else 0.0,
    )


async def guarded(send, request: Request, timing: Timing) -> None:
    """One request; an error (a 503, a reset) is counted on its timing, not raised."""
    try:
        await send(request, timing)
    except (OSError, RuntimeError, ValueError, mpengine.InvalidRequestError) as exc:
        timing.error = repr(exc)


# -- the two clients -------------------------------------------------------------------------


class HttpClient:
    """One keep-alive HTTP/1.1 connection that streams completions, or chat completions for
    a request with messages (SSE over chunked transfer encoding), enough of HTTP for this
    benchmark and nothing more."""

    def __init__(self, host: str, port: int, model: str) -> None:
        self.host, self.port, self.model = host, port, model
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def stream(self, request: Request, timing: Timing) -> None:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        assert self.reader is not None
        fields: dict[str, Any] = {
            "model": self.model,
            "max_tokens": request.max_tokens,
            "stream": True,
            "ignore_eos": True,
            "return_token_ids": True,  # (chat: on each content chunk; the role chunk has none)
        }
        if request.messages is None:
            path, fields["prompt"] = "/v1/completions", request.prompt_ids
        else:
            path, fields["messages"] = "/v1/chat/completions", request.messages
        body = json.dumps(fields).encode()
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {self.host}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        )
        timing.sent = time.perf_counter()
        self.writer.write(head.encode() + body)
        status = await self.reader.readline()
        if b" 200 " not in status:
            raise RuntimeError(f"HTTP error: {status!r}")
        while (await self.reader.readline()) not in (b"\r\n", b""):
            pass  # headers (chunked, keep-alive)
        pending = b""
        while True:
            size = int((await self.reader.readline()).strip(), 16)
            chunk = await self.reader.readexactly(size + 2)
            if size == 0:
                return
            pending += chunk[:-2]
            while b"\n\n" in pending:
                event, pending = pending.split(b"\n\n", 1)
                data = event.removeprefix(b"data: ")
                if data == b"[DONE]":
                    continue
                choices = json.loads(data)["choices"]
                count = sum(len(c.get("token_ids") or ()) for c in choices)
                timing.token(time.perf_counter(), count)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


async def ipc_stream(client: mpengine.AsyncClient, request: Request, timing: Timing) -> None:
    params = SamplingParams(max_tokens=request.max_tokens, ignore_eos=True)
    timing.sent = time.perf_counter()  # (chat: the template renders within the TTFT)
    if request.messages is None:
        deltas = client.stream(request.prompt_ids, params)
    else:
        deltas = client.chat_stream(request.messages, params)
    async for delta in deltas:
        timing.token(time.perf_counter(), len(delta.outputs[0].token_ids))


# -- load shapes -----------------------------------------------------------------------------


async def closed_loop(
    requests: list[Request], concurrency: int, make_worker, time_limit: float
) -> tuple[list[Timing], float]:
    """``concurrency`` clients, each sending its next request once the last one ended."""
    queue = list(reversed(requests))
    timings: list[Timing] = []
    start = time.perf_counter()

    async def worker() -> None:
        send, close = make_worker()
        try:
            while queue and time.perf_counter() - start < time_limit:
                timing = Timing(0.0)
                timings.append(timing)
                await guarded(send, queue.pop(), timing)
                if timing.error is not None:  # a fresh connection for the next one
                    close()
                    send, close = make_worker()
        finally:
            close()

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return timings, time.perf_counter() - start


async def open_loop(
    requests: list[Request], rate: float, make_worker, seed: int, time_limit: float
) -> tuple[list[Timing], float]:
    """Poisson arrivals at ``rate`` requests/s, each on a connection of its own, on an
    absolute schedule: a send that falls behind it does not delay the later ones, and its
    latencies count from when it was due."""
    rng = random.Random(seed)
    timings: list[Timing] = []
    tasks = []
    start = time.perf_counter()
    due = start

    async def one(request: Request, timing: Timing) -> None:
        send, close = make_worker()
        try:
            await guarded(send, request, timing)
        finally:
            close()

    for request in requests:
        if due - start > time_limit:
            break
        await asyncio.sleep(max(0.0, due - time.perf_counter()))
        timing = Timing(0.0, due=due)
        timings.append(timing)
        tasks.append(asyncio.create_task(one(request, timing)))
        due += rng.expovariate(rate)
    await asyncio.gather(*tasks)
    return timings, time.perf_counter() - start


# -- the runs --------------------------------------------------------------------------------


def start_server(
    args: argparse.Namespace, directory: str, replicas: int = 1
) -> tuple[subprocess.Popen, str, str]:
    """``mpengine serve`` with ``replicas`` data-parallel replicas: the process, its URL
    and the engine's address (every replica's, as it prints them)."""
    cmd = [sys.executable, "-m", "mpengine.cli", "serve", "--model", args.model, "--port", "0"]
    cmd += ["--address", f"ipc://{directory}/engine", "--log-level", "WARNING"]
    cmd += ["--device", args.device, "--data-parallel-size", str(replicas)]
    cmd += ["--max-num-seqs", str(max(args.concurrency, 8)), *args.engine_args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE)
    fd, pending, deadline = proc.stdout.fileno(), b"", time.monotonic() + 300
    while b"HTTP API at " not in pending:
        ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        data = os.read(fd, 65536) if ready else b""
        if not data:
            proc.kill()
            raise SystemExit(f"mpengine serve did not start: {pending.decode()}")
        pending += data
    url = pending.split(b"HTTP API at ", 1)[1].split()[0].decode().removesuffix("/v1")
    address = pending.split(b"mpengine: serving ", 1)[1].split(b"\n")[0].rsplit(b" at ", 1)[1]
    return proc, url, address.decode()


async def run_mode(
    mode: str, requests: list[Request], args: argparse.Namespace, url: str, client, rate=None
) -> Result:
    host, port = url.removeprefix("http://").rsplit(":", 1)

    def http_worker():
        conn = HttpClient(host, int(port), args.model)
        return conn.stream, conn.close

    def ipc_worker():
        return (lambda request, timing: ipc_stream(client, request, timing)), (lambda: None)

    make = http_worker if mode.startswith("http") else ipc_worker
    before = (await client.stats()).preemptions
    cpu = time.process_time()
    if rate is None:
        timings, seconds = await closed_loop(requests, args.concurrency, make, args.time_limit)
        load = f"C={args.concurrency}"
    else:
        timings, seconds = await open_loop(requests, rate, make, args.seed, args.time_limit)
        load = f"{rate:.1f} req/s"
    cpu = (time.process_time() - cpu) / seconds
    preemptions = (await client.stats()).preemptions - before
    return summarize(mode, load, timings, seconds, preemptions, cpu)


def hf_static(requests: list[Request], args: argparse.Namespace, model_path: str) -> Result:
    """The same requests through transformers' ``generate``, in static batches (with
    --chat: the conversations rendered by transformers' ``apply_chat_template``)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if any(r.messages is not None for r in requests):
        tokenizer = AutoTokenizer.from_pretrained(model_path)
        if not tokenizer.chat_template:
            raise ValueError(f"{model_path}: the tokenizer has no chat template")
        requests = [
            Request(
                tokenizer(
                    tokenizer.apply_chat_template(
                        r.messages, tokenize=False, add_generation_prompt=True
                    ),
                    add_special_tokens=False,
                ).input_ids,
                r.max_tokens,
                r.messages,
            )
            for r in requests
        ]

    # The engine's device and dtype ("auto": bfloat16 on CUDA, float32 on the CPU).
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).to(device).eval()
    pad = model.config.pad_token_id or 0
    timings = []
    with torch.no_grad():  # warm-up: one small batch
        model.generate(torch.tensor([[pad, 5, 6]], device=device), max_new_tokens=4)
    start = time.perf_counter()
    with torch.no_grad():
        for i in range(0, len(requests), args.concurrency):
            if time.perf_counter() - start > args.time_limit:
                break  # bounded like the other modes: the batches done so far count
            batch = requests[i : i + args.concurrency]
            width = max(len(r.prompt_ids) for r in batch)
            # Left-padded, as generate wants for decoder-only models.
            ids = torch.tensor([[pad] * (width - len(r.prompt_ids)) + r.prompt_ids for r in batch])
            lengths = torch.tensor([len(r.prompt_ids) for r in batch])
            mask = (torch.arange(width)[None, :] >= (width - lengths)[:, None]).long()
            longest = max(r.max_tokens for r in batch)
            model.generate(
                ids.to(device),
                attention_mask=mask.to(device),
                max_new_tokens=longest,
                min_new_tokens=longest,
                do_sample=False,
                pad_token_id=pad,
            )
            if cuda:
                torch.cuda.synchronize()
            ended = time.perf_counter()
            for r in batch:  # every request was there at the start; all end with the batch
                timings.append(
                    Timing(start, first=ended, last=ended, num_tokens=r.max_tokens, due=start)
                )
    seconds = time.perf_counter() - start
    return summarize("hf-static", f"batch={args.concurrency}", timings, seconds, 0)


def median_result(results: list[Result]) -> Result:
    """Every figure's median over the rounds (request and preemption counts too)."""
    counts = ("requests", "preemptions", "failed")
    numbers = {
        name: statistics.median(getattr(r, name) for r in results)
        for name in Result.__dataclass_fields__
        if name not in ("mode", "load", *counts)
    }
    first = results[0]
    return Result(
        first.mode,
        first.load,
        **{name: round(statistics.median(getattr(r, name) for r in results)) for name in counts},
        **numbers,  # type: ignore[arg-type]
    )


def print_table(results: list[Result]) -> None:
    head = (
        f"{'mode':<18}{'load':>13}{'reqs':>6}{'fail':>5}{'req/s':>8}{'tok/s':>9}"
        f"{'TTFT p50':>10}{'p99':>8}{'TPOT p50':>10}{'p99':>8}{'ITL p50':>9}{'p99':>8}"
        f"{'preempt':>9}{'client':>8}"
    )
    print(head)
    print("-" * len(head))
    for r in results:
        print(
            f"{r.mode:<18}{r.load:>13}{r.requests:>6}{r.failed:>5}{r.requests_per_s:>8.1f}"
            f"{r.tokens_per_s:>9.0f}{r.ttft_p50_ms:>10.1f}{r.ttft_p99_ms:>8.1f}"
            f"{r.tpot_p50_ms:>10.1f}{r.tpot_p99_ms:>8.1f}"
            f"{r.itl_p50_ms:>9.1f}{r.itl_p99_ms:>8.1f}{r.preemptions:>9}{r.client_cpu:>8.0%}"
        )
    print(
        "(latencies in ms, client-measured, from when each request was due; TPOT per request,"
        " ITL between received outputs (one may carry several tokens); client: this process's"
        " CPU share of a core; every column a median over rounds)"
    )


async def bench(args: argparse.Namespace, url: str, address: str, report: Report) -> dict:
    async with mpengine.AsyncClient(address) as client:
        if args.chat:
            requests = await asyncio.to_thread(engine_chat_workload, args, address)
            lengths = [len(r.prompt_ids) for r in requests]
            print(f"chat prompts: {min(lengths)}..{max(lengths)} tokens, as rendered")
        else:
            requests = workload(args, client.info.vocab_size)
        warm = requests[: args.concurrency]
        await run_mode("http", warm, args, url, client)  # warm both paths up
        await run_mode("ipc", warm, args, url, client)
        rounds: dict[str, list[Result]] = {"ipc": [], "http": []}
        for index in range(args.rounds):
            order = ("ipc", "http") if index % 2 == 0 else ("http", "ipc")  # neither always first
            for mode in order:
                rounds[mode].append(await run_mode(mode, requests, args, url, client))
            report.update(rounds={m: [asdict(r) for r in rs] for m, rs in rounds.items()})
        results = [median_result(rounds["ipc"]), median_result(rounds["http"])]
        capacity = results[1].requests_per_s
        for fraction in args.rate_fractions:
            rate = fraction * capacity
            results.append(await run_mode("http-poisson", requests, args, url, client, rate))
            report.update(results=[asdict(r) for r in results])
        model_path = client.info.model
    return {"results": results, "model_path": model_path, "rounds": rounds, "requests": requests}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--requests", type=int, default=256, help="requests per run")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompt-min", type=int, default=16)
    parser.add_argument("--prompt-max", type=int, default=256)
    parser.add_argument("--output-min", type=int, default=16)
    parser.add_argument("--output-max", type=int, default=128)
    parser.add_argument(
        "--rate-fractions",
        type=float,
        nargs="*",
        default=[0.5, 0.9],
        help="Poisson rates as fractions of the HTTP capacity at --concurrency",
    )
    parser.add_argument("--time-limit", type=float, default=120.0, help="seconds per run at most")
    parser.add_argument(
        "--chat",
        action="store_true",
        help="conversations through the chat template: /v1/chat/completions and chat_stream",
    )
    parser.add_argument("--no-hf", action="store_true", help="skip transformers' generate")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument(
        "--data-parallel-size",
        "-dp",
        type=int,
        nargs="+",
        default=[1],
        help="serve with each of these numbers of replicas in turn (-dp 1 2: one engine, "
        "then two behind the same front; on the CPU the cores split between them)",
    )
    parser.add_argument("--json", default="bench_serving.json")
    parser.add_argument(
        "engine_args", nargs="*", help="more `mpengine serve` flags (after --)", default=[]
    )
    args = parser.parse_args()
    stop_on_sigterm()
    report = Report(args.json, args)

    results: list[Result] = []
    rounds: dict[str, list] = {}
    sizes = args.data_parallel_size
    for size in sizes:
        with tempfile.TemporaryDirectory(prefix="bench-serving-") as directory:
            proc, url, address = start_server(args, directory, size)
            try:
                outcome = asyncio.run(bench(args, url, address, report))
            finally:
                proc.send_signal(signal.SIGTERM)
                proc.wait(60)
        label = f" dp{size}" if len(sizes) > 1 else ""
        for result in outcome["results"]:
            result.mode += label
        results += outcome["results"]
        rounds |= {mode + label: runs for mode, runs in outcome["rounds"].items()}
    if not args.no_hf:
        try:
            results.append(hf_static(outcome["requests"], args, outcome["model_path"]))
        except Exception as exc:  # the engine's figures are kept
            report.update(hf_error=repr(exc))
            print(f"hf-static failed: {exc!r}")
    print_table(results)
    ipc, http = results[0], results[1]
    added = {
        "ttft_p50_ms": http.ttft_p50_ms - ipc.ttft_p50_ms,
        "ttft_p99_ms": http.ttft_p99_ms - ipc.ttft_p99_ms,
    }
    ratios = {
        "http_over_ipc_requests_per_s": http.requests_per_s / ipc.requests_per_s,
        "http_over_ipc_tokens_per_s": http.tokens_per_s / ipc.tokens_per_s,
    }
    scaling = {}
    for size in sizes[1:]:  # each size's HTTP and IPC throughput over the first size's
        for mode in ("ipc", "http"):
            base = next(r for r in results if r.mode == f"{mode} dp{sizes[0]}")
            more = next(r for r in results if r.mode == f"{mode} dp{size}")
            scaling[f"{mode}_dp{size}_over_dp{sizes[0]}"] = more.tokens_per_s / base.tokens_per_s
    for name, ratio in scaling.items():
        print(f"{name}: {ratio:.2f}x the tokens/s")
    print(
        f"\nHTTP layer at C={args.concurrency}: "
        f"{ratios['http_over_ipc_tokens_per_s']:.2f}x the IPC tokens/s, "
        f"{ratios['http_over_ipc_requests_per_s']:.2f}x its requests/s; "
        f"added TTFT p50 {added['ttft_p50_ms']:+.1f} ms, p99 {added['ttft_p99_ms']:+.1f} ms"
    )
    # NaN (no inter-token latency) as null: strict JSON.
    report.finish(
        results=_nan_to_none([asdict(r) for r in results]),
        rounds=_nan_to_none({m: [asdict(r) for r in rs] for m, rs in rounds.items()}),
        data_parallel_scaling=scaling,
        http_added=_nan_to_none(added),
        ratios=ratios,
    )
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()

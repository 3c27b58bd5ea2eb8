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
from dataclasses import asdict, dataclass, field
from typing import Any

import mpengine
from mpengine import SamplingParams
from mpengine.testing.bench import Report, percentile, stop_on_sigterm


@dataclass
class Request:
    prompt_ids: list[int]
    max_tokens: int


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
    """One keep-alive HTTP/1.1 connection that streams completions (SSE over chunked
    transfer encoding), enough of HTTP for this benchmark and nothing more."""

    def __init__(self, host: str, port: int, model: str) -> None:
        self.host, self.port, self.model = host, port, model
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def stream(self, request: Request, timing: Timing) -> None:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        assert self.reader is not None
        body = json.dumps(
            {
                "model": self.model,
                "prompt": request.prompt_ids,
                "max_tokens": request.max_tokens,
                "stream": True,
                "ignore_eos": True,
                "return_token_ids": True,
            }
        ).encode()
        head = (
            f"POST /v1/completions HTTP/1.1\r\nHost: {self.host}\r\n"
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
    timing.sent = time.perf_counter()
    async for delta in client.stream(request.prompt_ids, params):
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


def start_server(args: argparse.Namespace, directory: str) -> tuple[subprocess.Popen, str, str]:
    cmd = [sys.executable, "-m", "mpengine.cli", "serve", "--model", args.model, "--port", "0"]
    cmd += ["--address", f"ipc://{directory}/engine", "--log-level", "WARNING"]
    cmd += ["--device", args.device]
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
    return proc, url, f"ipc://{directory}/engine/requests.sock"


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
    """The same requests through transformers' ``generate``, in static batches."""
    import torch
    from transformers import AutoModelForCausalLM

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
        f"{'mode':<13}{'load':>13}{'reqs':>6}{'fail':>5}{'req/s':>8}{'tok/s':>9}"
        f"{'TTFT p50':>10}{'p99':>8}{'TPOT p50':>10}{'p99':>8}{'ITL p50':>9}{'p99':>8}"
        f"{'preempt':>9}{'client':>8}"
    )
    print(head)
    print("-" * len(head))
    for r in results:
        print(
            f"{r.mode:<13}{r.load:>13}{r.requests:>6}{r.failed:>5}{r.requests_per_s:>8.1f}"
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
    parser.add_argument("--no-hf", action="store_true", help="skip transformers' generate")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--json", default="bench_serving.json")
    parser.add_argument(
        "engine_args", nargs="*", help="more `mpengine serve` flags (after --)", default=[]
    )
    args = parser.parse_args()
    stop_on_sigterm()
    report = Report(args.json, args)

    with tempfile.TemporaryDirectory(prefix="bench-serving-") as directory:
        proc, url, address = start_server(args, directory)
        try:
            outcome = asyncio.run(bench(args, url, address, report))
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
    results: list[Result] = outcome["results"]
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
    print(
        f"\nHTTP layer at C={args.concurrency}: "
        f"{ratios['http_over_ipc_tokens_per_s']:.2f}x the IPC tokens/s, "
        f"{ratios['http_over_ipc_requests_per_s']:.2f}x its requests/s; "
        f"added TTFT p50 {added['ttft_p50_ms']:+.1f} ms, p99 {added['ttft_p99_ms']:+.1f} ms"
    )
    # NaN (no inter-token latency) as null: strict JSON.
    report.finish(
        results=_nan_to_none([asdict(r) for r in results]),
        rounds=_nan_to_none({m: [asdict(r) for r in rs] for m, rs in outcome["rounds"].items()}),
        http_added=_nan_to_none(added),
        ratios=ratios,
    )
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()

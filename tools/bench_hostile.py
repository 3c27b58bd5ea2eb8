"""What hostile requests cost a running ``mpengine serve``: bounded work before admission.

Starts ``mpengine serve`` (``--model``, default tiny) and, while one client reads a long
stream, sends each hostile request of the security review once: a 15.6 MB text prompt, a
chat of 450,000 messages, ``/detokenize`` of 7M ids, 15 MB of one-token prompts, a request
head sent a byte at a time; two grammars near the bounds of structured outputs; and one
request that would hold every seat for minutes (4,000 prompts x n=64: refused; 4 prompts x
n=64 of 4,000 tokens: served), timing another client's 4-token request beside it.
For each: the answer's status, how long it took, the server's resident memory after it, and
the longest gap between two chunks of the other client's stream meanwhile. Prints a table
and writes JSON.

    python tools/bench_hostile.py --json bench_hostile.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import select
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

TIMEOUT_S = 120.0


def start(model: str, directory: str) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "mpengine.cli", "serve", model, "--port", "0"]
    cmd += ["--address", f"ipc://{directory}/engine", "--log-level", "WARNING"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    watchdog = threading.Timer(TIMEOUT_S, proc.kill)  # (a server that never says it serves)
    watchdog.start()
    try:
        for line in proc.stdout:
            if "HTTP API at " in line:
                return proc, line.split("HTTP API at ", 1)[1].split()[0].removesuffix("/v1")
    finally:
        watchdog.cancel()
    proc.kill()
    raise SystemExit("mpengine serve did not start")


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def post(url: str, path: str, data: bytes) -> tuple[int, float]:
    request = urllib.request.Request(url + path, data, {"Content-Type": "application/json"})
    start = time.perf_counter()
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S) as reply:
            reply.read()
            status = reply.status
    except urllib.error.HTTPError as error:
        error.read()
        status = error.code
    except urllib.error.URLError:  # (closed while the body was sent: refused unread)
        status = -1
    return status, time.perf_counter() - start


def slow_head(url: str) -> tuple[int, float]:
    """A request head sent a byte every 0.2 s: seconds until the server closes it (0: it
    waited past the limit of this run, 60 s)."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=TIMEOUT_S) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\n")
        start = time.perf_counter()
        while time.perf_counter() - start < 60:
            try:
                sock.sendall(b"X")
            except OSError:
                return 0, time.perf_counter() - start
            ready, _, _ = select.select([sock], [], [], 0.2)
            if ready and sock.recv(1) == b"":
                return 0, time.perf_counter() - start
    return -1, 60.0


def beside_hog(url: str) -> tuple[int, float]:
    """A 4-token request while one request's 4 prompts x n=64 (256 sequences, every seat
    of the default ``max_num_seqs``) stream 4,000 tokens each: its status and seconds (it
    waited for the big one, 38 s, before fair shares)."""
    body = {"prompt": [[1, 2, 3]] * 4, "n": 64, "max_tokens": 4000, "stream": True}
    body |= {"ignore_eos": True}
    request = urllib.request.Request(
        url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=TIMEOUT_S) as hog:
        for _ in itertools.islice(hog, 256):  # under way: its first chunks arrived
            pass
        small = json.dumps({"prompt": [[4, 5, 6, 7]], "max_tokens": 4}).encode()
        return post(url, "/v1/completions", small)


class Stream(threading.Thread):
    """Another client's long stream; ``gap()`` is the longest wait between two chunks
    since the last call."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        body = {"prompt": "Once upon a time", "max_tokens": 4000, "stream": True}
        body |= {"ignore_eos": True}
        self.request = urllib.request.Request(
            url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        self.last = time.perf_counter()
        self.longest = 0.0
        self.done = False
        self.lock = threading.Lock()

    def run(self) -> None:
        with urllib.request.urlopen(self.request, timeout=TIMEOUT_S) as reply:
            for _ in reply:
                now = time.perf_counter()
                with self.lock:
                    self.longest = max(self.longest, now - self.last)
                    self.last = now
        self.done = True

    def gap(self) -> float:
        """The longest wait for a chunk since the last call (while the stream lasted)."""
        with self.lock:
            waiting = 0.0 if self.done else time.perf_counter() - self.last
            longest, self.longest = max(self.longest, waiting), 0.0
        return longest


def cases(url: str) -> list[tuple[str, object]]:
    text = json.dumps({"prompt": "word " * 3_120_000, "max_tokens": 1}).encode()  # 15.6 MB
    message = {"role": "user", "content": "x"}
    chat = json.dumps({"messages": [message] * 450_000, "max_tokens": 1}).encode()  # 15.3 MB
    ids = json.dumps({"tokens": [1] * 7_000_000}, separators=(",", ":")).encode()  # 14 MB
    prompts = json.dumps({"prompt": [[1]] * 3_000_000, "max_tokens": 1}, separators=(",", ":"))
    # Grammars near the bounds of structured outputs (256 KB of text, 1,024 choices; within
    # the body limit): what checking them at admission and compiling them in the executor
    # costs (once each).
    choices = [f"x{i}" + "a" * 1000 for i in range(1024)]
    choice = json.dumps({"prompt": "a", "max_tokens": 4, "guided_choice": choices}).encode()
    fields = {f"field{i}": {"type": "string"} for i in range(5000)}
    schema = {"type": "object", "properties": fields, "required": list(fields)}
    wide = json.dumps({"prompt": "a", "max_tokens": 4, "guided_json": schema}).encode()
    hog = {"prompt": [[1, 2, 3]] * 4000, "n": 64, "max_tokens": 4000, "stream": True}
    huge = json.dumps(hog | {"ignore_eos": True}).encode()
    return [
        ("15.6 MB text prompt", lambda: post(url, "/v1/completions", text)),
        ("chat of 450,000 messages", lambda: post(url, "/v1/chat/completions", chat)),
        ("/detokenize of 7M ids", lambda: post(url, "/detokenize", ids)),
        ("15 MB of one-token prompts", lambda: post(url, "/v1/completions", prompts.encode())),
        ("request head a byte every 0.2 s", lambda: slow_head(url)),
        ("1,024 choices of 1 KB", lambda: post(url, "/v1/completions", choice)),
        ("JSON schema of 5,000 fields", lambda: post(url, "/v1/completions", wide)),
        ("4,000 prompts x n=64", lambda: post(url, "/v1/completions", huge)),
        ("4 tokens beside 4 prompts x n=64", lambda: beside_hog(url)),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--json", default="bench_hostile.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        proc, url = start(args.model, directory)
        try:
            rows = []
            for name, run in cases(url):
                stream = Stream(url)  # (a fresh one each: it outlasts the case)
                stream.start()
                time.sleep(1.0)  # (under way before the case)
                stream.gap()
                status, seconds = run()
                rows.append(
                    {
                        "case": name,
                        "status": status,
                        "seconds": round(seconds, 3),
                        "server_rss_mb": round(rss_mb(proc.pid), 1),
                        "stream_gap_s": round(stream.gap(), 3),
                        "stream_outlasted_case": not stream.done,
                    }
                )
                row = rows[-1]
                print(
                    f"{name:<34} status {status:>4}  {seconds:7.2f} s  server "
                    f"{row['server_rss_mb']:7.1f} MB  stream gap {row['stream_gap_s']:.2f} s",
                    flush=True,
                )
        finally:
            proc.terminate()
            proc.wait(60)
    record = {"model": args.model, "rows": rows, "cpus": os.cpu_count()}
    Path(args.json).write_text(json.dumps(record, indent=2))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()

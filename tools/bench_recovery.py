"""What a stage's death costs the streams in flight: SIGKILL one stage under N greedy
streams and compare every stream with an undisturbed run.

For each stage (``--stages``): launch an engine (``--model``, default tiny), run the
streams once undisturbed, then again, killing the stage once every stream has
``--kill-after`` tokens. Reports whether every stream got exactly the tokens and text of
the undisturbed run (the output processor and the executor; the scheduler's requests fail,
to be retried), the longest gap between two deltas of any stream across the restart, how
long the launcher took to have the stage running again, and the wall time of both runs.
Prints a table and writes JSON.

    python tools/bench_recovery.py --streams 32 --max-tokens 400 --json bench_recovery.json
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import threading
import time
from pathlib import Path

import mpengine
from mpengine import SamplingParams

TIMEOUT_S = 300.0


class Run:
    """N streams read by a thread each: tokens, text, the longest gap between deltas."""

    def __init__(self, client: mpengine.Client, prompts: list[list[int]], params) -> None:
        self.tokens: list[list[int]] = [[] for _ in prompts]
        self.texts: list[list[str]] = [[] for _ in prompts]
        self.last = [time.monotonic()] * len(prompts)
        self.gap = [0.0] * len(prompts)
        self.errors: list[str] = []
        self.started = time.monotonic()
        self.threads = [
            threading.Thread(target=self._read, args=(client, i, p, params), daemon=True)
            for i, p in enumerate(prompts)
        ]
        for thread in self.threads:
            thread.start()

    def _read(self, client: mpengine.Client, i: int, prompt: list[int], params) -> None:
        try:
            for delta in client.stream(prompt, params, timeout=TIMEOUT_S):
                now = time.monotonic()
                self.gap[i] = max(self.gap[i], now - self.last[i])
                self.last[i] = now
                self.tokens[i] += delta.outputs[0].token_ids
                self.texts[i].append(delta.outputs[0].text)
        except Exception as exc:
            self.errors.append(f"{type(exc).__name__}: {exc}")

    def least(self) -> int:
        return min(map(len, self.tokens))

    def join(self) -> float:
        for thread in self.threads:
            thread.join(TIMEOUT_S)
        return time.monotonic() - self.started

    def result(self) -> list[tuple[list[int], str]]:
        return [(t, "".join(x)) for t, x in zip(self.tokens, self.texts, strict=True)]


def measure(model: str, stage: str, args: argparse.Namespace) -> dict:
    prompts = [[5 + i % 50, 6 + i // 50, 7, 8] for i in range(args.streams)]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    engine = mpengine.launch(model, log_level="WARNING")
    try:
        with engine.client() as client:
            quiet = Run(client, prompts, params)
            quiet_s = quiet.join()
            run = Run(client, prompts, params)
            while run.least() < args.kill_after and not run.errors:
                time.sleep(0.001)
            pid = engine.pids[stage]
            killed = time.monotonic()
            os.kill(pid, signal.SIGKILL)
            while engine.pids.get(stage) == pid or engine.recovering:
                if engine.dead or time.monotonic() - killed > TIMEOUT_S:
                    break
                time.sleep(0.001)
            back_s = time.monotonic() - killed
            run_s = run.join()
            same = sum(a == b for a, b in zip(run.result(), quiet.result(), strict=True))
            return {
                "stage": stage,
                "streams": args.streams,
                "identical": same,
                "failed": len(run.errors),
                "error": run.errors[0] if run.errors else None,
                "longest_gap_s": round(max(run.gap), 3),
                "restarted_in_s": round(back_s, 3),
                "undisturbed_s": round(quiet_s, 2),
                "with_kill_s": round(run_s, 2),
                "restarts": dict(engine.restarts.total),
            }
    finally:
        engine.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--stages", nargs="+", default=["output", "executor", "scheduler"])
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=400)
    parser.add_argument("--kill-after", type=int, default=100, help="tokens every stream has")
    parser.add_argument("--json", default="bench_recovery.json")
    args = parser.parse_args()
    rows = []
    for stage in args.stages:
        row = measure(args.model, stage, args)
        rows.append(row)
        print(
            f"{stage:<10} identical {row['identical']:>3}/{row['streams']}  failed "
            f"{row['failed']:>3}  longest gap {row['longest_gap_s']:6.3f} s  restarted in "
            f"{row['restarted_in_s']:6.3f} s  run {row['with_kill_s']:6.2f} s (undisturbed "
            f"{row['undisturbed_s']:.2f} s)",
            flush=True,
        )
    record = {"model": args.model, "rows": rows, "cpus": os.cpu_count()}
    Path(args.json).write_text(json.dumps(record, indent=2))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()

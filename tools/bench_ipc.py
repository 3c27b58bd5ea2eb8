"""Hop latency and throughput between two processes: shm ring vs ZMQ ipc:// vs mp.Queue.

    python tools/bench_ipc.py [--sizes 64,1024,65536,1048576] [--scale 1.0] [--repeat 3]
                              [--json PATH]

For each transport and frame size one child process is spawned; it serves two phases:

- latency (ping-pong): the parent sends a frame, the child sends one of the same size
  back; one hop is half the measured round trip (no cross-process clock needed). Median
  and p99 over all round trips after a warm-up.
- throughput: the parent streams frames as fast as the transport accepts them, the child
  receives them all and answers with one ack; frames/s and MB/s over the whole stream.

Each row is run ``--repeat`` times (interleaved with the other rows) and every metric
reported is the median over the repeats: on a shared machine single runs swing by 3x.
Every transport delivers a ``bytes`` object to the receiver. ``--spin-us`` overrides the
ring's spin budget (several values: one shm row each), ``--load N`` runs N busy processes
alongside, ``--echo-delay-us`` makes the child busy-wait before answering a ping.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from statistics import median
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import shm
from shm.wait import SPIN_S

RING_CAPACITY = 8 << 20
Send = Callable[[bytes], None]
Recv = Callable[[], bytes]


def open_shm(spec: dict[str, Any], parent: bool) -> tuple[Send, Recv, Callable[[], None]]:
    spin_s = spec["spin_us"] * 1e-6
    if parent:
        out = shm.Ring.create(spec["engine_id"], "ping", RING_CAPACITY, spin_s=spin_s)
        back = shm.Ring.create(spec["engine_id"], "pong", RING_CAPACITY, spin_s=spin_s)
        spec["names"] = (out.name, back.name)
    else:
        back = shm.Ring.attach(spec["names"][0], spin_s=spin_s)
        out = shm.Ring.attach(spec["names"][1], spin_s=spin_s)

    def close() -> None:
        out.close()
        back.close()

    return out.put, back.get, close


def open_zmq(spec: dict[str, Any], parent: bool) -> tuple[Send, Recv, Callable[[], None]]:
    import zmq

    ctx = zmq.Context()
    if parent:
        spec["dir"] = tempfile.mkdtemp(prefix="bench-ipc-")
    a, b = (f"ipc://{spec['dir']}/{side}" for side in ("ab", "ba"))
    push, pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    if parent:
        push.bind(a)
        pull.bind(b)
    else:
        push.connect(b)
        pull.connect(a)
    big = spec["size"] >= 65536  # pyzmq's advice: zero-copy sends only pay off for large frames

    def send(frame: bytes) -> None:
        push.send(frame, copy=not big)

    def close() -> None:
        push.close(linger=0)
        pull.close(linger=0)
        ctx.term()
        if parent:
            for side in ("ab", "ba"):
                Path(spec["dir"], side).unlink(missing_ok=True)
            os.rmdir(spec["dir"])

    return send, pull.recv, close


def open_mpq(spec: dict[str, Any], parent: bool) -> tuple[Send, Recv, Callable[[], None]]:
    if parent:
        spec["queues"] = (mp.get_context("spawn").Queue(), mp.get_context("spawn").Queue())
    out, back = spec["queues"] if parent else spec["queues"][::-1]

    def close() -> None:
        # Frames nobody will read (the peer was killed, by Ctrl-C say) must not keep the
        # queue's feeder thread, and so the interpreter's exit, waiting on a full pipe.
        for queue in (out, back):
            queue.cancel_join_thread()
            queue.close()

    return out.put, back.get, close


TRANSPORTS = {"shm": open_shm, "zmq": open_zmq, "mpq": open_mpq}


def exit_with_parent() -> None:
    """End this process once the benchmark's is gone (killed, it cannot stop its children,
    and a child blocked on a read would wait forever)."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, daemon=True).start()


def child(spec: dict[str, Any]) -> None:
    """Echo ``lat_iters`` pings, then sink ``tput_frames`` frames and send one ack."""
    exit_with_parent()
    send, recv, close = TRANSPORTS[spec["transport"]](spec, parent=False)
    delay = spec["echo_delay_us"] * 1e-6
    for _ in range(spec["lat_iters"]):
        frame = recv()
        if delay:
            until = time.perf_counter() + delay
            while time.perf_counter() < until:
                pass
        send(frame)
    for _ in range(spec["tput_frames"]):
        recv()
    send(b"ack")
    recv()  # the parent's go-ahead to close: ZMQ must not drop the ack at teardown
    close()


def burn() -> None:
    """Keep a core busy until the benchmark's process is gone (a SIGTERM or SIGKILL to it
    skips the cleanup that stops its burners)."""
    parent = os.getppid()
    while os.getppid() == parent:
        for _ in range(100_000):
            pass


def run_one(spec: dict[str, Any]) -> dict[str, Any]:
    send, recv, close = TRANSPORTS[spec["transport"]](spec, parent=True)
    proc = mp.get_context("spawn").Process(target=child, args=(spec,), daemon=True)
    proc.start()
    try:
        frame = os.urandom(spec["size"])
        hops: list[float] = []
        cpu0 = time.process_time()
        for i in range(spec["lat_iters"]):
            t0 = time.perf_counter()
            send(frame)
            reply = recv()
            if i >= spec["warmup"]:
                hops.append((time.perf_counter() - t0) / 2)
        cpu_lat = time.process_time() - cpu0
        assert len(reply) == spec["size"]
        t0 = time.perf_counter()
        for _ in range(spec["tput_frames"]):
            send(frame)
        assert recv() == b"ack"
        elapsed = time.perf_counter() - t0
        send(b"bye")
        proc.join(timeout=60)
        assert proc.exitcode == 0, f"child exited with {proc.exitcode}"
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join()
        close()
    hops.sort()
    n = spec["tput_frames"]
    return {
        "hop_median_us": median(hops) * 1e6,
        "hop_p99_us": hops[min(len(hops) - 1, int(len(hops) * 0.99))] * 1e6,
        "parent_cpu_per_round_trip_us": cpu_lat / spec["lat_iters"] * 1e6,
        "frames_per_s": n / elapsed,
        "mb_per_s": n * spec["size"] / elapsed / 1e6,
    }


def counts(size: int, scale: float) -> tuple[int, int]:
    """(round trips, throughput frames) per run for a frame size: a default run (3 repeats)
    takes 1-2 minutes."""
    lat = 10_000 if size <= 4096 else 3_000 if size <= 65536 else 300
    tput = min(100_000, max(200, (256 << 20) // size))
    return max(50, int(lat * scale)), max(10, int(tput * scale))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="64,1024,65536,1048576")
    parser.add_argument("--transports", default="shm,zmq,mpq")
    parser.add_argument("--scale", type=float, default=1.0, help="multiply iteration counts")
    parser.add_argument("--repeat", type=int, default=3, help="runs per row; medians reported")
    parser.add_argument("--spin-us", default=str(SPIN_S * 1e6), help="ring spin budget(s), us")
    parser.add_argument("--load", type=int, default=0, help="busy processes alongside")
    parser.add_argument("--echo-delay-us", type=float, default=0.0)
    parser.add_argument("--json", default="bench_ipc.json")
    args = parser.parse_args()

    burners = [mp.get_context("spawn").Process(target=burn, daemon=True) for _ in range(args.load)]
    for b in burners:
        b.start()
    runs: dict[tuple[str, int], list[dict[str, float]]] = {}
    try:
        # Repeats are interleaved, so a burst of load from elsewhere hits every transport alike.
        for rep in range(args.repeat):
            for size in (int(s) for s in args.sizes.split(",")):
                lat_iters, tput_frames = counts(size, args.scale)
                for transport in args.transports.split(","):
                    spins = (
                        [float(s) for s in args.spin_us.split(",")] if transport == "shm" else [0]
                    )
                    for spin_us in spins:
                        label = transport if len(spins) == 1 else f"shm(spin {spin_us:g}us)"
                        spec = {
                            "transport": transport,
                            "size": size,
                            "lat_iters": lat_iters,
                            "warmup": lat_iters // 10,
                            "tput_frames": tput_frames,
                            "spin_us": spin_us,
                            "echo_delay_us": args.echo_delay_us,
                            "engine_id": "bench" + uuid.uuid4().hex[:8],
                        }
                        runs.setdefault((label, size), []).append(run_one(spec))
            print(f"run {rep + 1}/{args.repeat} done", file=sys.stderr, flush=True)
    finally:
        for b in burners:
            b.kill()
            b.join()
    # Per metric, the median over the repeats.
    rows = [
        {"transport": label, "size": size, **{k: median(r[k] for r in rs) for k in rs[0]}}
        for (label, size), rs in runs.items()
    ]
    for i, row in enumerate(rows):
        print_row(row, header=i == 0)
    report = {
        "hop": "ping-pong round trip / 2, parent clock",
        "cpu_count": os.cpu_count(),
        "load_processes": args.load,
        "echo_delay_us": args.echo_delay_us,
        "ring_spin_us": args.spin_us,
        "repeats": args.repeat,
        "rows": rows,
    }
    print_summary(rows)
    Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.json}")


def print_row(row: dict[str, Any], header: bool) -> None:
    if header:
        print("hop = ping-pong round trip / 2; cpu/rt = parent CPU time per round trip")
        print(
            f"{'transport':<18}{'size':>9}{'hop p50 us':>12}{'hop p99 us':>12}"
            f"{'cpu/rt us':>11}{'frames/s':>12}{'MB/s':>10}"
        )
    print(
        f"{row['transport']:<18}{row['size']:>9}{row['hop_median_us']:>12.1f}"
        f"{row['hop_p99_us']:>12.1f}{row['parent_cpu_per_round_trip_us']:>11.1f}"
        f"{row['frames_per_s']:>12.0f}{row['mb_per_s']:>10.1f}",
        flush=True,
    )


def print_summary(rows: list[dict[str, Any]]) -> None:
    """Each shm row (one per spin budget) against zmq at the same size."""
    by = {(r["transport"], r["size"]): r for r in rows}
    for size in sorted({r["size"] for r in rows}):
        zmq = by.get(("zmq", size))
        rings = [r for r in rows if r["size"] == size and r["transport"].startswith("shm")]
        for ring in rings if zmq else []:
            ratio = zmq["hop_median_us"] / ring["hop_median_us"]
            versus = f"{ratio:.2f}x faster" if ratio >= 1 else f"{1 / ratio:.2f}x slower"
            print(
                f"{size:>8} B: {ring['transport']} hop {ring['hop_median_us']:.1f} us, "
                f"{versus} than zmq ipc ({zmq['hop_median_us']:.1f} us)"
            )


if __name__ == "__main__":
    main()

"""Backpressure: 32 streaming requests with and without a client that never reads.

The stalled client connects raw sockets, greets the engine, asks for one long request
(``--stalled-tokens``) and then reads nothing. Past ``client_send_hwm`` queued messages (and
the socket buffers) the engine aborts its requests; until then it costs what one more
sequence in the batch costs (by default it asks for as many tokens as the others), and the
other clients should notice no more than that: the output processor never waits for it,
and its queue stays bounded. Rounds alternate (without, with) so a shared machine's
drifts hit all alike. A raw client that does read its outputs is the control: the table
shows medians of tokens/s of the 32 well-behaved requests in each case.

    python tools/bench_backpressure.py --rounds 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time

import zmq

import mpengine
from mpengine import SamplingParams
from mpengine.protocol import AddRequest, Array, Hello, encoder, scheduler_reply_decoder
from mpengine.testing.engine import wait_idle


def stall(
    ctx: zmq.Context, engine: mpengine.Engine, name: str, max_tokens: int
) -> list[zmq.Socket]:
    """A raw client that greets and asks for a long output; it reads nothing unless the
    caller drains its output socket (the second one returned)."""
    sockets = []

    def connect(address: str) -> zmq.Socket:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTING_ID, name.encode())
        sock.setsockopt(zmq.RCVHWM, 1)
        sock.connect(address)
        sock.send(encoder.encode(Hello(name)))
        if not sock.poll(10_000):
            raise TimeoutError("no greeting")
        sockets.append(sock)
        return sock

    requests = connect(engine.address)
    info = scheduler_reply_decoder().decode(requests.recv())
    connect(info.output_address).recv()
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    requests.send(encoder.encode(AddRequest("long", Array.of([5, 6]), params)))
    return sockets


def read_all(sock: zmq.Socket, stop: threading.Event) -> None:
    while not stop.is_set():
        if sock.poll(50):
            sock.recv()


def run_round(client: mpengine.Client, num_streams: int, max_tokens: int) -> float:
    prompts = [f"stream {i} " * (1 + i % 5) for i in range(num_streams)]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    outs = client.generate_many(prompts, params, timeout=600)
    elapsed = time.perf_counter() - start
    return sum(len(o.token_ids) for o in outs) / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--client-send-hwm", type=int, default=1000)
    parser.add_argument("--stalled-tokens", type=int, default=None, help="default: --max-tokens")
    parser.add_argument("--json", default="bench_backpressure.json")
    args = parser.parse_args()

    engine = mpengine.launch(
        model=args.model,
        num_gpu_blocks_override=4096,
        max_num_seqs=128,
        client_send_hwm=args.client_send_hwm,
        log_level="WARNING",
    )
    cases = ("alone", "beside a raw client that reads", "beside a raw client that never reads")
    rates: dict[str, list[float]] = {case: [] for case in cases}
    ctx = zmq.Context()
    try:
        with engine, engine.client() as client:
            run_round(client, args.streams, 16)  # warm-up
            for round_index in range(args.rounds):
                rates["alone"].append(run_round(client, args.streams, args.max_tokens))
                for reads in (True, False):
                    name = f"{'reader' if reads else 'stalled'}-{round_index}"
                    sockets = stall(ctx, engine, name, args.stalled_tokens or args.max_tokens)
                    stop = threading.Event()
                    drain = threading.Thread(target=read_all, args=(sockets[1], stop))
                    if reads:
                        drain.start()
                    rate = run_round(client, args.streams, args.max_tokens)
                    rates[cases[1] if reads else cases[2]].append(rate)
                    wait_idle(client, timeout=300)  # its request ended (or was aborted)
                    stop.set()
                    if reads:
                        drain.join()
                    for sock in sockets:
                        sock.close(linger=0)
                print(
                    f"round {round_index}: "
                    + ", ".join(f"{case} {rates[case][-1]:.0f}" for case in cases)
                    + " tok/s",
                    flush=True,
                )
    finally:
        ctx.destroy(linger=0)
    alone = statistics.median(rates["alone"])
    print(f"\n| {args.streams} streams x {args.max_tokens} tokens | tokens/s (median) |")
    print("|---|---|")
    for case in cases:
        rate = statistics.median(rates[case])
        print(f"| {case} | {rate:.0f} ({rate / alone:.2f}x) |")
    with open(args.json, "w") as f:
        json.dump({"args": vars(args), "tokens_per_s": rates}, f, indent=2)


if __name__ == "__main__":
    main()

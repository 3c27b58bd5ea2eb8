"""Data-parallel replicas: two give one engine's greedy tokens with both at work; pinned
requests, aborts and stats follow their replica; prefix affinity keeps a prefix on one
replica; a killed replica fails only its own requests, leaves the rotation and comes
back; ``mpengine serve -dp 2`` over HTTP; a front for replicas started elsewhere, over
tcp with a token, one of them out of reach."""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

import mpengine
from mpengine.protocol import SamplingParams
from mpengine.testing.engine import free_port_pair
from tests.e2e.conftest import leftovers
from tests.e2e.test_executor import hf_greedy
from tests.e2e.test_server_cli import _lines, serving

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
PROMPTS = [[7 + i, 300 + 5 * i, 42, 9 + i] * (2 + i % 3) for i in range(8)]
LONG = SamplingParams(max_tokens=1000, temperature=0, ignore_eos=True)
DEADLINE_S = 30.0


def wait_for(check, what: str, timeout: float = DEADLINE_S) -> None:
    """Poll ``check()`` until true; fail naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"{what}: not within {timeout} s"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def replicas():
    """Two replicas of tiny."""
    options = dict(model="tiny", max_model_len=2048, num_threads=1, startup_timeout=120.0)
    engine = mpengine.launch(data_parallel_size=2, **options)
    try:
        yield engine
    finally:
        engine.shutdown()
        left = [e for config in engine.configs for e in leftovers(config.engine_id)]
        assert not left and not os.path.exists(engine.runtime_dir), left


def test_two_replicas_give_one_engine_s_tokens_and_both_work(replicas) -> None:
    """transformers' greedy tokens (as one engine gives them: test_executor), both
    replicas at work, each replica's stages titled and counted."""
    hf = AutoModelForCausalLM.from_pretrained(replicas.model.model_path, dtype=torch.float32)
    expected = [hf_greedy(hf, np.array(p), GREEDY.max_tokens)[0] for p in PROMPTS]
    assert isinstance(replicas, mpengine.data_parallel.DataParallelEngine)
    assert sorted(replicas.pids) == sorted(
        f"{stage} dp{i}" for stage in ("scheduler", "executor", "output") for i in (0, 1)
    )
    for name, pid in replicas.pids.items():  # titled by replica, for ps, stacks and top
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            assert f.read().split(b"\0")[0].decode() == f"mpengine: {name}"
    with replicas.client() as client:
        assert client.data_parallel_size == 2
        outs = client.generate_many(PROMPTS, GREEDY)
        assert [o.token_ids for o in outs] == expected
        assert {o.metrics.data_parallel_rank for o in outs} == {0, 1}
        each = [client.stats(data_parallel_rank=r).admitted for r in (0, 1)]
        assert min(each) > 0 and client.stats().admitted == sum(each)
        assert sorted(client.stats().stages) == sorted(replicas.pids)


def test_a_pin_runs_there_and_an_abort_follows_its_request(replicas) -> None:
    with replicas.client() as client:
        before = client.stats(data_parallel_rank=1).admitted
        out = client.generate(PROMPTS[0], GREEDY, data_parallel_rank=1)
        assert out.metrics.data_parallel_rank == 1
        assert client.stats(data_parallel_rank=1).admitted == before + 1
        with pytest.raises(mpengine.InvalidRequestError, match="has 2 replicas"):
            client.generate(PROMPTS[0], GREEDY, data_parallel_rank=2)
        # An abort by request id reaches the replica that runs it.
        stream = client.stream(PROMPTS[1], LONG, request_id="pinned", data_parallel_rank=1)
        first = next(stream)
        assert first.metrics.data_parallel_rank == 1
        client.abort("pinned")
        last = [d for d in stream][-1]
        assert last.finished and last.outputs[0].finish_reason == "abort"
    alone = mpengine.Client(replicas.addresses[0])  # one replica's own address
    with alone, pytest.raises(mpengine.InvalidRequestError, match="one replica"):
        alone.generate(PROMPTS[0], GREEDY, data_parallel_rank=1)


def test_prefix_affinity_keeps_a_prefix_on_its_replica(replicas) -> None:
    shared = [[5, 6, 7, 8] * 16 + [100 + i] for i in range(6)]  # 4 full blocks alike
    with mpengine.Client(replicas.address, routing="prefix_affinity") as client:
        ranks = {client.generate(p, GREEDY).metrics.data_parallel_rank for p in shared}
        assert len(ranks) == 1  # one after the other: the load stays even
        (rank,) = ranks
        assert client.stats(data_parallel_rank=rank).prefix_cache_hits >= 5 * 64


def test_a_killed_replica_fails_its_own_requests_and_comes_back(replicas) -> None:
    """Its scheduler killed: its streams end within 5 s, the other replica's go on and
    take the new requests; it rejoins once its engine restarted it. (A replica whose
    engine gives up is started again whole: test_ray_placement kills one.)"""
    client = replicas.client()
    results: dict[int, tuple] = {}

    def run(rank: int) -> None:
        started = time.monotonic()
        try:
            for _ in client.stream(PROMPTS[rank], LONG, data_parallel_rank=rank):
                pass
            results[rank] = ("finished", time.monotonic() - started)
        except mpengine.EngineDeadError as exc:
            results[rank] = ("failed", time.monotonic())
            assert "scheduler" in str(exc)

    old = dict(replicas.pids)
    threads = [threading.Thread(target=run, args=(rank,)) for rank in (0, 1)]
    for thread in threads:
        thread.start()
    wait_for(lambda: client.stats().num_running == 2, "both streams running")
    killed_at = time.monotonic()
    os.kill(replicas.pids["scheduler dp1"], signal.SIGKILL)
    threads[1].join(DEADLINE_S)
    assert results[1][0] == "failed" and results[1][1] - killed_at < 5.0
    # Out of the rotation at once: new requests go to the other replica.
    assert client.replica_problems()[1] is not None
    assert client.generate(PROMPTS[2], GREEDY).metrics.data_parallel_rank == 0
    threads[0].join(DEADLINE_S)
    assert results[0][0] == "finished"
    wait_for(lambda: client.replica_problems() == [None, None], "the replica back")
    assert replicas.pids["scheduler dp1"] != old["scheduler dp1"]
    assert replicas.pids["scheduler dp0"] == old["scheduler dp0"]
    assert client.generate(PROMPTS[2], GREEDY, data_parallel_rank=1).token_ids
    client.close()


def get(url: str, headers: dict | None = None, body: dict | None = None) -> tuple[int, dict]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        url, data, {"Content-Type": "application/json", **(headers or {})}
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            text = reply.read().decode()
            return reply.status, json.loads(text) if text.startswith("{") else {"text": text}
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def completion(url: str, prompt: list[int], rank: int | None = None) -> tuple[int, dict]:
    headers = {} if rank is None else {"X-data-parallel-rank": str(rank)}
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0}
    return get(url + "/v1/completions", headers, body)


def test_serve_data_parallel_over_http(tmp_path: Path) -> None:
    """32 concurrent completions over two replicas; every metric names its replica; the
    header pins one; health lists them."""
    with serving(tmp_path, "--data-parallel-size", "2", "--num-threads", "1") as served:
        prompts = [[3 + i % 5, 40 + i, 7] for i in range(32)]
        with concurrent.futures.ThreadPoolExecutor(32) as pool:
            answers = list(pool.map(lambda p: completion(served.url, p), prompts))
        assert [status for status, _ in answers] == [200] * 32
        assert all(body["usage"]["completion_tokens"] == 8 for _, body in answers)
        status, pinned = completion(served.url, prompts[0], rank=1)
        assert status == 200 and pinned["choices"][0]["text"] == answers[0][1]["choices"][0]["text"]
        status, refused = completion(served.url, prompts[0], rank=2)
        assert status == 400 and "2 replicas" in refused["error"]["message"]
        metrics = get(served.url + "/metrics")[1]["text"]
        series = [line for line in metrics.splitlines() if line.startswith("mpengine:")]
        assert series and all('engine="' in line for line in series)
        tokens = {
            line.split('engine="')[1][0]: float(line.split()[-1])
            for line in series
            if line.startswith("mpengine:generation_tokens_total")
        }
        assert tokens.keys() == {"0", "1"} and min(tokens.values()) > 0
        assert sum(tokens.values()) == 8 * 33  # (the refused pin ran nothing)
        health = get(served.url + "/health")[1]
        assert health["status"] == "ok" and [r["engine"] for r in health["replicas"]] == ["0", "1"]
        printed = f"ipc://{tmp_path}/engine/dp0,ipc://{tmp_path}/engine/dp1"
        top = subprocess.run(
            [sys.executable, "-m", "mpengine.cli", "top", printed, "--once", "--interval", "0.2"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert top.returncode == 0, top.stderr
        assert "replica 0" in top.stdout and "replica 1" in top.stdout
        assert "executor dp1" in top.stdout
        stacks = subprocess.run(
            [sys.executable, "-m", "mpengine.cli", "stacks", printed, "--faulthandler"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert stacks.returncode == 0, stacks.stderr
        assert stacks.stdout.count("=== scheduler (pid") == 2, stacks.stdout


def test_a_front_for_replicas_started_elsewhere(tmp_path: Path) -> None:
    """``mpengine serve --headless`` on loopback tcp with a token, and a front ``mpengine
    serve --engine-address`` for it and for a second engine out of reach: it serves,
    reports the second, and routes around it. (Routing between live replicas is the
    client's, as tested above.)"""
    token = tmp_path / "token"
    token.write_text("s3cret-token\n")
    address = f"tcp://127.0.0.1:{free_port_pair()}"
    cmd = [sys.executable, "-m", "mpengine.cli", "serve", "tiny", "--headless"]
    cmd += ["--address", address, "--auth-token-file", str(token), "--num-threads", "1"]
    cmd += ["--log-level", "WARNING"]
    with open(tmp_path / "headless.log", "w") as err:
        engine = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err)
    try:
        line = next(_lines(engine, time.monotonic() + 120, tmp_path / "headless.log"))
        assert line.endswith(f"at {address}"), line
        nowhere = f"tcp://127.0.0.1:{free_port_pair()}"
        front = ["--auth-token-file", str(token)]
        front += ["--engine-address", address, "--engine-address", nowhere]
        with serving(tmp_path / "front", *front) as served:
            status, body = completion(served.url, [5, 6, 7], 0)
            assert status == 200, body
            status, body = completion(served.url, [5, 6, 7], 1)
            assert status == 503 and "replica 1 is not serving" in body["error"]["message"]
            assert completion(served.url, [5, 6, 7])[0] == 200  # routed around it
            health = get(served.url + "/health")[1]
            assert health["status"] == "degraded"
            assert [r["problem"] is None for r in health["replicas"]] == [True, False]
            metrics = get(served.url + "/metrics")[1]["text"]
            assert 'mpengine:engine_up{engine="1",model_name="tiny"} 0.0' in metrics
            assert 'mpengine:engine_up{engine="0",model_name="tiny"} 1.0' in metrics
    finally:
        engine.send_signal(signal.SIGTERM)  # (a drain, then exit 0)
        assert engine.wait(60) == 0

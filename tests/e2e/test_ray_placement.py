"""Data-parallel replicas placed by Ray (``runtime/ray_replicas.py``) on a local Ray
cluster: each replica's engine runs in a Ray actor and serves transformers' greedy tokens
over tcp; a killed actor is told, its replica placed again and taken back by the client;
nothing is left behind; a replica no node can hold is refused, saying why."""

from __future__ import annotations

import glob
import os
import re
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

import mpengine
from mpengine.errors import EngineStartError
from mpengine.protocol import SamplingParams
from mpengine.runtime.engine_file import process_title
from mpengine.runtime.ray_replicas import RayReplica, connect_ray, gpus_per_replica
from tests.e2e.conftest import leftovers
from tests.e2e.test_executor import hf_greedy

ray = pytest.importorskip("ray")

TOKEN = "ray-placement-token"
PROMPT = [5, 6, 7, 8, 300, 42]
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def config_kwargs(**overrides: object) -> dict[str, object]:
    """A small tiny engine of its own id, reached with ``TOKEN``."""
    kwargs = dict(
        model="tiny",
        max_model_len=256,
        kv_cache_bytes=4 << 20,
        num_threads=1,
        engine_id="r" + uuid.uuid4().hex[:8],
        auth_token=TOKEN,
        startup_timeout=120.0,
    )
    return kwargs | overrides


def config(**overrides: object) -> mpengine.EngineConfig:
    return mpengine.EngineConfig.from_kwargs(**config_kwargs(**overrides))


def wait_for(done: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            raise AssertionError(f"not {what} after {timeout} s")
        time.sleep(0.02)


def parent_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def gone(pids: dict[str, int]) -> bool:
    return not any(os.path.exists(f"/proc/{pid}") for pid in pids.values())


def runtime_dirs(engine_id: str) -> list[str]:
    return glob.glob(os.path.join(tempfile.gettempdir(), f"mpengine-{engine_id}-*"))


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[None]:
    """A local Ray cluster of this host's CPUs (even where RAY_ADDRESS names another),
    stopped after the module, failed or not."""
    connect_ray("local")
    yield
    ray.shutdown()


def test_replicas_placed_by_ray_serve_and_one_killed_comes_back(ray_cluster) -> None:
    """Two replicas as Ray actors (each stage a child of its actor's worker) give
    transformers' greedy tokens over tcp with a token, both at work. An actor killed:
    told within 10 s, its replica out of the rotation while the other serves, then placed
    again (another port, maybe another node) and taken back by the client. A shutdown
    ends every stage and leaves nothing in /dev/shm or the temp dir."""
    engine = mpengine.launch(
        data_parallel_size=2, distributed_executor_backend="ray", **config_kwargs()
    )
    client = None
    try:
        client = engine.client()
        hf = AutoModelForCausalLM.from_pretrained(engine.model.model_path, dtype=torch.float32)
        expected, gaps = hf_greedy(hf, np.array(PROMPT), GREEDY.max_tokens)
        outs = client.generate_many([PROMPT] * 4, GREEDY, timeout=60)
        assert all(list(out.token_ids) == expected for out in outs), gaps
        assert {out.metrics.data_parallel_rank for out in outs} == {0, 1}
        for replica in engine.replicas:
            assert replica.address.startswith(f"tcp://{replica.node_ip}:"), replica.address
            for stage, pid in replica.pids.items():
                assert process_title(pid) == f"mpengine: {stage} dp{replica.index}"
                assert process_title(parent_of(pid)) == "ray::ReplicaActor", stage
        first, killed = engine.replicas
        reasons, told = watch(killed)
        pids, old_address = killed.pids, killed.address
        ray.kill(killed.actor)
        assert told.wait(10), "on_death did not fire within 10 s of ray.kill"
        assert "Ray actor" in reasons[0] and "ray.kill" in reasons[0], reasons
        wait_for(lambda: gone(pids), 10, f"every stage gone with the actor: {pids}")
        wait_for(lambda: client.replica_problems()[1] is not None, 10, "out of the rotation")
        assert client.generate(PROMPT, GREEDY, timeout=60).metrics.data_parallel_rank == 0
        wait_for(lambda: engine.replicas[1] is not killed, 60, "placed again")
        wait_for(lambda: client.replica_problems() == [None, None], 30, "taken back")
        again = client.generate(PROMPT, GREEDY, data_parallel_rank=1, timeout=60)
        assert list(again.token_ids) == expected
        assert engine.restarts.total == {"replica 1": 1}
        assert engine.replicas[1].address != old_address or engine.replicas[1].pids != pids
        pids = {**first.pids, **engine.replicas[1].pids}
    finally:
        if client is not None:
            client.close()
        engine.shutdown()
    wait_for(lambda: gone(pids), 10, f"every stage gone: {pids}")
    for replica_config in engine.configs:  # (the killed actor's too: its reaper's work)
        assert leftovers(replica_config.engine_id) == []
        assert runtime_dirs(replica_config.engine_id) == []


def watch(replica: RayReplica) -> tuple[list[str], threading.Event]:
    """What ``replica.on_death`` is told, and when."""
    reasons: list[str] = []
    told = threading.Event()
    replica.on_death(lambda reason: (reasons.append(reason), told.set()))
    return reasons, told


def test_replica_no_node_can_hold_is_refused(ray_cluster) -> None:
    """Asked for more CPUs than the cluster has: refused within startup_timeout, with
    what it asked for and what the cluster has."""
    cpus = ray.cluster_resources()["CPU"]
    with pytest.raises(EngineStartError) as failed:
        RayReplica(config(startup_timeout=0.5), index=3, num_cpus=cpus + 1)
    message = str(failed.value)
    assert f"asks for {cpus + 1:g} CPU" in message and f"has {cpus:g} CPU" in message, message
    wait_for(lambda: ray.available_resources().get("CPU") == cpus, 10, "its bundle removed")


def test_gpus_per_replica() -> None:
    tp2 = dict(model="tiny", tensor_parallel_size=2)
    assert gpus_per_replica(mpengine.EngineConfig.from_kwargs(**tp2, device="cuda"), 0) == 2
    assert gpus_per_replica(mpengine.EngineConfig.from_kwargs(**tp2, device="auto"), 8) == 2
    assert gpus_per_replica(mpengine.EngineConfig.from_kwargs(**tp2, device="auto"), 0) == 0
    assert gpus_per_replica(mpengine.EngineConfig.from_kwargs(**tp2, device="cpu"), 8) == 0


def test_without_ray_the_backend_says_how_to_install_it(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # (import ray: ImportError)
    expected = "--distributed-executor-backend ray needs Ray: pip install 'mpengine[ray]'"
    with pytest.raises(EngineStartError, match=re.escape(expected)):
        connect_ray(None)

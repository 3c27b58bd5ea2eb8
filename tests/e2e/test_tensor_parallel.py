"""Tensor parallelism on the CPU: two executor ranks over gloo give one rank's greedy
tokens (several architectures, with preemption, prefix caching, async depth 1); models
two ranks cannot split are refused before loading; a rank that dies ends the engine;
ranks on two "hosts"."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import msgspec
import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import mpengine
from mpengine.executor.tensor_parallel import check_plan
from mpengine.models.resolve import resolve_model
from mpengine.protocol import SamplingParams
from mpengine.testing.engine import free_port_pair
from tests.e2e.conftest import leftovers
from tests.e2e.test_diagnose import cli
from tests.e2e.test_executor import build_model, hf_greedy

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
# Twelve prompts, two of them sharing a 40-token prefix (prefix caching), long enough
# together that 16 blocks of 16 cannot hold them all (preemption).
PROMPTS = [[7 + i, 300 + 5 * i, 42, 9 + i] * (3 + i % 4) for i in range(10)]
PROMPTS += [[11, 12, 13, 14] * 10 + [100], [11, 12, 13, 14] * 10 + [200]]


def run(engine: mpengine.Engine, params: list[SamplingParams]) -> list[list[list[int]]]:
    with engine.client() as client:
        outs = client.generate_many(PROMPTS, params, timeout=120)
        return [[list(c.token_ids) for c in out.outputs] for out in outs]


def params() -> list[SamplingParams]:
    """Greedy mostly, two seeded samples of n=2 (drawn by rank 0, the others follow)."""
    seeded = SamplingParams(max_tokens=16, temperature=1.0, seed=3, n=2, ignore_eos=True)
    return [seeded if i in (2, 5) else GREEDY for i in range(len(PROMPTS))]


def test_two_ranks_give_one_ranks_tokens(start_engine, tmp_path) -> None:
    """Greedy and seeded tokens of one rank, under preemption and prefix caching; every
    rank is a titled stage that ``stacks``, ``stats`` and ``top`` show, with its time in
    collectives."""
    options = dict(model="tiny", num_gpu_blocks_override=16, max_num_seqs=8, num_threads=1)
    one = start_engine(**options)
    expected = run(one, params())
    one.shutdown()
    two = start_engine(tensor_parallel_size=2, address=f"ipc://{tmp_path}/e", **options)
    assert sorted(two.pids) == ["executor", "executor tp1", "output", "scheduler"]
    for stage, pid in two.pids.items():
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            assert f.read().split(b"\0")[0].decode() == f"mpengine: {stage}"
    assert run(two, params()) == expected
    with two.client() as client:
        client.generate([5, 6, 7], SamplingParams(max_tokens=70, ignore_eos=True), timeout=60)
        stats = client.stats()
    assert stats.preemptions > 0 and stats.prefix_cache_hits > 0, stats
    assert two.model is not None and two.model.num_blocks == 16
    for rank in ("executor", "executor tp1"):  # (the other ranks' reach rank 0 every 64 steps)
        times = stats.stages[rank]
        assert times.phases["collective"] > 0 and times.steps >= 64, stats.stages
    out = cli("stacks", two.address, "--faulthandler").stdout
    for stage in ("executor", "executor tp1"):
        header = f"=== {stage} (pid {two.pids[stage]}) ==="
        assert "in run_stage" in out.split(header, 1)[1].split("===", 1)[0], out
    top = cli("top", two.address, "--once", "--interval", "0.2").stdout
    assert any(line.startswith("executor tp1") for line in top.splitlines()), top


# (Gemma, Mistral, Qwen2, OLMo, Granite, Cohere, Starcoder2 and the MoE families split
# alike too: checked by hand, left out of the suite for its time.)
_FAMILIES = {"llama": {"num_key_value_heads": 2}, "phi3": {}}


@pytest.mark.parametrize("model_type", sorted(_FAMILIES))
def test_other_families_split_alike(start_engine, tmp_path, model_type: str) -> None:
    """Random models of other families with a plan (phi3: one fused qkv projection), two
    ranks against transformers' greedy tokens (one rank gives them: test_executor.py)."""
    path = build_model(tmp_path, model_type, vocab_size=2048, **_FAMILIES[model_type])
    options = dict(model=path, tokenizer=resolve_model("tiny-llama"), num_threads=1)
    engine = start_engine(tensor_parallel_size=2, **options)
    with engine.client() as client:
        outs = client.generate_many(PROMPTS[:6], GREEDY, timeout=120)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    for prompt, out in zip(PROMPTS[:6], outs, strict=True):
        expected, gaps = hf_greedy(hf, np.array(prompt), GREEDY.max_tokens)
        assert list(out.outputs[0].token_ids) == expected, (prompt, gaps)


def test_refusals_name_the_reason() -> None:
    """Checked by each rank before it joins the others (one of them end to end below)."""
    cpu = torch.device("cpu")
    llama = AutoConfig.for_model(
        "llama", hidden_size=96, num_attention_heads=6, num_key_value_heads=3
    )
    with pytest.raises(
        ValueError, match=r"divide the model's query heads \(6\) and KV heads \(3\)"
    ):
        check_plan(llama, "causal", 2, cpu)
    check_plan(llama, "causal", 3, cpu)
    with pytest.raises(ValueError, match="gpt2 models have no tensor-parallel plan"):
        check_plan(AutoConfig.for_model("gpt2"), "causal", 2, cpu)
    with pytest.raises(ValueError, match="bert is an embedding model"):
        check_plan(AutoConfig.for_model("bert"), "encoder", 2, cpu)
    with pytest.raises(ValueError, match="needs a GPU per rank"):
        check_plan(llama, "causal", 3, torch.device("cuda"))


def test_a_model_that_cannot_be_split_is_refused_in_one_line(start_engine) -> None:
    with pytest.raises(mpengine.EngineStartError) as info:
        start_engine(model="tiny-gpt2", tensor_parallel_size=2, num_threads=1)
    message = str(info.value)
    reason = "tensor_parallel_size 2: gpt2 models have no tensor-parallel plan in transformers"
    assert reason in message and "\n" not in message, message


def test_configs_that_cannot_place_ranks_are_refused() -> None:
    with pytest.raises(ValueError, match="needs the processes runtime"):
        mpengine.EngineConfig(runtime="serial", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="nnodes 2 must divide tensor_parallel_size 3"):
        mpengine.EngineConfig(tensor_parallel_size=3, nnodes=2, master_port=29500)
    with pytest.raises(ValueError, match="node_rank 2 be below it"):
        mpengine.EngineConfig(tensor_parallel_size=2, nnodes=2, node_rank=2, master_port=29500)
    with pytest.raises(ValueError, match="needs master_port"):
        mpengine.EngineConfig(tensor_parallel_size=2, nnodes=2)
    config = mpengine.EngineConfig(tensor_parallel_size=4, nnodes=2, master_port=29500)
    assert config.ranks_per_node == 2
    with pytest.raises(mpengine.EngineStartError, match="mpengine serve --headless"):
        mpengine.Engine(msgspec.structs.replace(config, node_rank=1))


def test_a_killed_rank_fails_every_stream_and_leaves_nothing(start_engine) -> None:
    """(Rank 0's death is an executor's death: ``test_supervision.py``.)"""
    engine = start_engine(model="tiny", tensor_parallel_size=2, num_threads=1)
    errors: dict[int, BaseException] = {}
    started = threading.Barrier(4, timeout=60)

    def stream(i: int, client: mpengine.Client) -> None:
        tokens = client.stream([5 + i] * 8, SamplingParams(max_tokens=3000, ignore_eos=True))
        try:
            next(tokens)
            started.wait()
            for _ in tokens:
                pass
        except BaseException as exc:
            errors[i] = exc

    clients = [engine.client() for _ in range(3)]
    threads = [threading.Thread(target=stream, args=(i, c)) for i, c in enumerate(clients)]
    for thread in threads:
        thread.start()
    started.wait()
    os.kill(engine.pids["executor tp1"], signal.SIGKILL)
    killed_at = time.monotonic()
    for thread in threads:
        thread.join(10)
        assert not thread.is_alive(), "a stream hung after a rank died"
    elapsed = time.monotonic() - killed_at
    assert sorted(errors) == [0, 1, 2]
    assert all(isinstance(e, mpengine.EngineDeadError) for e in errors.values()), errors
    assert elapsed < 2.0, f"the streams ended {elapsed:.2f} s after the rank died"
    assert engine.stopped.wait(10), "the supervisor did not stop the engine"
    assert "died" in (engine.dead or "")
    for client in clients:
        client.close()
    assert not leftovers(engine.config.engine_id)
    assert not os.path.exists(engine.runtime_dir)


def test_ranks_on_two_nodes(start_engine, tmp_path) -> None:
    """Two "hosts" on loopback: node 1 runs its rank headless (``mpengine serve
    --headless``) and takes the plans over ZMQ with the engine's auth token; it ends once
    the engine does."""
    port = free_port_pair()  # the process group's, and the plans' (port + 1)
    token_file = tmp_path / "token"
    token_file.write_text("a-test-token-of-enough-length\n")
    token_file.chmod(0o600)
    node = ["--headless", "--node-rank", "1", "--auth-token-file", str(token_file)]
    nodes = ["-tp", "2", "--nnodes", "2", "--master-port", str(port), "--num-threads", "1"]
    log = open(tmp_path / "node1.log", "w")  # noqa: SIM115  (closed below)
    node1 = subprocess.Popen(
        [sys.executable, "-m", "mpengine.cli", "serve", "tiny", *node, *nodes],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        engine = start_engine(
            model="tiny",
            tensor_parallel_size=2,
            nnodes=2,
            master_port=port,
            num_threads=1,
            auth_token=token_file.read_text().strip(),
        )
        assert sorted(engine.pids) == ["executor", "output", "scheduler"]
        with engine.client() as client:
            outs = client.generate_many(PROMPTS[:4], GREEDY, timeout=120)
        hf = AutoModelForCausalLM.from_pretrained(resolve_model("tiny"), dtype=torch.float32)
        for prompt, out in zip(PROMPTS[:4], outs, strict=True):
            assert (
                list(out.outputs[0].token_ids)
                == hf_greedy(hf, np.array(prompt), GREEDY.max_tokens)[0]
            )
        engine.shutdown()
        assert node1.wait(30) == 1, (tmp_path / "node1.log").read_text()
        assert "went away" in (tmp_path / "node1.log").read_text()
    finally:
        if node1.poll() is None:
            node1.kill()
            node1.wait(10)
        log.close()

"""The executor with its GPU attention path, run on the CPU under the Triton interpreter.

Greedy tokens through the triton backend must equal Hugging Face's, like the torch
backend's (tests/e2e/test_executor.py). The decode graphs' static buffers are checked with
an eager stand-in for the captured graph: the same buffers, padding rows and replay, only
nothing is captured (that needs a GPU). The interpreter only works if TRITON_INTERPRET=1 is
set before triton is first imported, so without a GPU these tests run in a child pytest.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.e2e.test_executor import GREEDY, Driver, Seq, hf_greedy, hf_model, prompts
from tests.e2e.test_executor import make_executor as make_torch_executor

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
PYTEST = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
ON_GPU = torch.cuda.is_available()


@pytest.fixture(scope="module")
def backend_ready() -> None:
    pytest.importorskip("triton", reason="triton is not installed (the test extra has it)")
    if not ON_GPU and not INTERPRETED:
        pytest.skip("runs in a child process under the interpreter (see the test below)")
    importlib.import_module("mpengine.executor.triton_attention")


def make_executor(model: str, **overrides: object):
    from mpengine.config import EngineConfig
    from mpengine.executor import Executor

    # float32: the kernels' exact mode, so Hugging Face's float32 tokens are the reference
    # on a GPU too (its default there is bfloat16).
    kwargs = dict(
        model=model,
        block_size=4,
        num_gpu_blocks_override=512,
        max_num_seqs=3,
        num_threads=1,
        dtype="float32",
    )
    kwargs.update(overrides)
    return Executor(EngineConfig.from_kwargs(**kwargs), attention_backend="triton")


def test_triton_executor_under_the_interpreter() -> None:
    pytest.importorskip("triton", reason="triton is not installed (the test extra has it)")
    if ON_GPU or INTERPRETED:
        pytest.skip("the triton executor tests run in this process")
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-k",
            "not interpreter",
            str(Path(__file__).resolve()),
        ],
        cwd=root,
        env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        timeout=900,
    )
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    assert done.returncode == 0 and "passed" in summary and "skipped" not in summary, (
        f"{summary}\n{done.stdout[-4000:]}\n{done.stderr[-2000:]}"
    )


def test_triton_greedy_matches_hf(backend_ready) -> None:
    """Staggered arrivals, chunked prefill mixed into decode steps, shuffled blocks (a
    lighter workload than the torch backend's: the interpreter is slow)."""
    executor = make_executor("tiny")
    assert executor.backend == "triton"
    assert (executor.graphs is not None) == ON_GPU  # decode steps replay graphs on CUDA
    seqs = [
        Seq(i, p, GREEDY, max_tokens=6, arrival=i)
        for i, p in enumerate(prompts(executor.info.vocab_size, [1, 21, 6, 38]))
    ]
    driver = Driver(executor, chunk=16, budget=24)
    driver.run(seqs)
    assert driver.mixed_steps >= 2
    hf = hf_model(executor)
    for s in seqs:
        assert s.output == hf_greedy(hf, s.prompt, s.max_tokens)[0], s.seq_id


def test_decode_graph_buffers_replay_exactly(backend_ready) -> None:
    """Decode steps replayed through the graphs' static buffers (padding rows included:
    batches of 3 run in the size-4 buffers) give HF's tokens, and the padding rows store
    nothing in the cache."""
    from mpengine.executor.cuda_graphs import DecodeGraphs

    class EagerGraph:
        def __init__(self, run) -> None:
            self.replay = run

    class EagerGraphs(DecodeGraphs):
        def _capture_all(self) -> None:
            for size in self.sizes:
                metadata = self._metadata(size)
                self.logits[size] = self._forward(size, metadata)

                def run(size: int = size, metadata=metadata) -> None:
                    self.logits[size].copy_(self._forward(size, metadata))

                self.graphs[size] = EagerGraph(run)

    executor = make_executor("tiny", max_num_seqs=4)
    graphs = EagerGraphs(executor.model, executor.kv_caches, [1, 2, 4], 64)
    with torch.inference_mode():
        graphs._capture_all()
    executor.graphs = graphs
    replays = []
    original = graphs.replay

    def counting(inputs):
        replays.append(inputs.metadata.num_tokens)
        return original(inputs)

    graphs.replay = counting
    lengths, max_tokens = [5, 17, 9], [4, 7, 2]
    seqs = [
        Seq(i, p, GREEDY, max_tokens=max_tokens[i], arrival=i)
        for i, p in enumerate(prompts(executor.info.vocab_size, lengths))
    ]
    before = executor.kv_caches[0].clone()
    driver, handed = Driver(executor, chunk=8, budget=24), set()
    execute = driver._execute

    def recording(plan, scheduled):
        handed.update(plan.block_ids.numpy().tolist())
        return execute(plan, scheduled)

    driver._execute = recording
    driver.run(seqs)
    assert {1, 3} <= set(replays), replays  # a lone decode, and 3 padded to 4
    hf = hf_model(executor)
    for s in seqs:
        assert s.output == hf_greedy(hf, s.prompt, s.max_tokens)[0], s.seq_id
    # Only blocks the driver handed out were written (padding rows store nothing).
    changed = (executor.kv_caches[0] != before).flatten(3).any(-1).any(0).any(0)
    assert set(np.flatnonzero(changed.cpu().numpy()).tolist()) <= handed


def test_torch_and_triton_executors_agree_on_logprobs(backend_ready) -> None:
    """A sampled request's logprobs through either backend agree to float32 rounding."""
    from mpengine.protocol import SamplingParams

    params = SamplingParams(temperature=0.0, logprobs=3)
    outputs = []
    torch_executor = make_torch_executor("tiny", attention_backend="torch", dtype="float32")
    for executor in (torch_executor, make_executor("tiny")):
        seqs = [Seq(0, prompts(2048, [20], 5)[0], params, max_tokens=4)]
        Driver(executor, chunk=16).run(seqs)
        outputs.append(seqs[0])
    torch_seq, triton_seq = outputs
    assert torch_seq.output == triton_seq.output
    np.testing.assert_allclose(
        [lp for lp, _ in torch_seq.logprobs], [lp for lp, _ in triton_seq.logprobs], atol=1e-5
    )

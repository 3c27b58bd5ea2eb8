"""GPU memory sizing and CUDA-graph batch sizes, checked on the CPU.

The profiling forward that sizes a GPU's KV cache is an ordinary paged forward on a
throwaway cache: it runs (and must match Hugging Face) on the CPU too. The byte arithmetic
is plain functions. Capturing and replaying graphs needs a GPU and is not run here.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from mpengine.config import EngineConfig, GiB
from mpengine.executor.cuda_graphs import graph_batch_sizes, max_graph_batch
from mpengine.executor.gpu_memory import (
    graph_pool_estimate,
    kv_cache_budget,
    profile_forward,
    profile_sampler,
)
from mpengine.executor.kv_cache import KVCacheSpec
from mpengine.executor.model_loader import load_model
from mpengine.models.resolve import resolve_model


def test_budget_is_a_share_of_the_total() -> None:
    # 80 GiB device, 0.5 of it: 40 GiB less weights + activations, workspaces and graphs.
    budget = kv_cache_budget(80 * GiB, 0.5, torch_peak=10 * GiB, non_torch=GiB, graph_pool=GiB)
    assert budget == 28 * GiB
    # Another engine's usage does not enter: the same share whatever was free.
    assert kv_cache_budget(80 * GiB, 0.25, 4 * GiB, 0, 0) == 16 * GiB


def test_graph_pool_estimate_scales_with_the_largest_batch() -> None:
    # Activations of 2048 profiled tokens were 1 GiB; a 256-row graph keeps an eighth of it,
    # and every captured size keeps its own logits (sizes summing to 2,311 rows).
    estimate = graph_pool_estimate(GiB, 2048, graph_batch_sizes(256), logits_row_bytes=1000)
    assert estimate == GiB // 8 + 2_311_000
    assert sum(graph_batch_sizes(256)) == 2311
    assert graph_pool_estimate(GiB, 16, [256], 0) == GiB  # never more than the profile


def test_graph_batch_sizes() -> None:
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(3) == [1, 2, 4]
    sizes = graph_batch_sizes(256)
    assert sizes[:6] == [1, 2, 4, 8, 16, 24] and sizes[-1] == 256
    assert 64 in sizes and 72 not in sizes and 80 in sizes  # steps of 8, then of 16
    assert graph_batch_sizes(100)[-1] == 112  # the last size covers max_num_seqs


def test_graphs_only_for_decode_steps_that_can_run() -> None:
    """A pure-decode step has a token per sequence: no larger than the token budget (sizes
    past it were captured, never replayed, and each kept its own logits); and no larger
    than vLLM's default capture limit (at 1,024 sequences and a 152k vocabulary the
    graphs' logits alone took 10 GB)."""
    assert max_graph_batch(EngineConfig(max_num_seqs=256, max_num_batched_tokens=64)) == 64
    assert max_graph_batch(EngineConfig(max_num_seqs=256, max_num_batched_tokens=8192)) == 256
    big = EngineConfig(max_num_seqs=1024, max_num_batched_tokens=8192)
    assert graph_batch_sizes(max_graph_batch(big))[-1] == 512


def spec_of(loaded) -> KVCacheSpec:
    return KVCacheSpec(
        num_layers=loaded.num_layers,
        num_kv_heads=loaded.num_kv_heads,
        head_dim=loaded.head_dim,
        block_size=16,
        dtype=loaded.dtype,
    )


def test_profile_forward_is_a_real_forward() -> None:
    """150 tokens with max_model_len 64 run as sequences of 64, 64 and 22 tokens (input id
    0 everywhere): the last-token logits match Hugging Face's on those inputs."""
    config = EngineConfig(model="tiny", max_model_len=64, num_threads=1, device="cpu")
    loaded = load_model(config)
    spec = spec_of(loaded)
    with torch.inference_mode():
        logits = profile_forward(loaded, spec, "torch", num_tokens=150, max_num_seqs=8)
        profile_sampler(loaded, num_rows=8, seed=0)
    assert logits.shape == (3, loaded.vocab_size)
    reference = AutoModelForCausalLM.from_pretrained(loaded.path, dtype=torch.float32).eval()
    with torch.no_grad():
        for row, length in enumerate([64, 64, 22]):
            expected = reference(torch.zeros(1, length, dtype=torch.int64)).logits[0, -1]
            np.testing.assert_allclose(logits[row].numpy(), expected.numpy(), atol=1e-4)


def test_profile_forward_of_a_model_without_an_lm_head(tmp_path) -> None:
    """A decoder saved without its head (an embedding model) profiles through its hidden
    states: reading ``.logits`` failed the GPU start-up of every such model."""
    import shutil
    from pathlib import Path

    from transformers import AutoModel

    tiny = Path(resolve_model("tiny"))
    AutoModel.from_pretrained(tiny).save_pretrained(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny / name, tmp_path / name)
    config = EngineConfig(model=str(tmp_path), max_model_len=64, num_threads=1, device="cpu")
    loaded = load_model(config)
    assert not loaded.can_generate
    spec = spec_of(loaded)
    with torch.inference_mode():
        hidden = profile_forward(loaded, spec, "torch", num_tokens=100, max_num_seqs=8)
    assert hidden.shape == (2, loaded.model.config.hidden_size)
    assert torch.isfinite(hidden).all()


def test_memory_is_read_on_the_configured_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """``cuda:1`` read the current device's memory (``cuda:0``) and made a context there."""
    from mpengine.executor.gpu_memory import MemoryStart

    calls: list[tuple[str, object]] = []
    monkeypatch.setattr(torch.cuda, "init", lambda: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(("set", d)))

    def mem_get_info(device: object = None) -> tuple[int, int]:
        calls.append(("read", device))
        return 3 * GiB, 8 * GiB

    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    second = torch.device("cuda:1")
    assert MemoryStart.take(second) == MemoryStart(3 * GiB, 8 * GiB)
    assert calls == [("set", second), ("read", second)]
    calls.clear()
    MemoryStart.take(torch.device("cuda"))  # the current device: nothing to set
    assert calls == [("read", torch.device("cuda"))]


def test_the_sampler_profile_includes_penalties_over_whole_contexts(monkeypatch) -> None:
    """Penalties allocate counts over the vocabulary and each row's context: left out of
    the profile (about 0.5 GB at 256 rows, a 152k vocabulary and 32k contexts), they could
    run a full KV cache's device out of memory in the first penalised step."""
    from mpengine.executor import sampler

    config = EngineConfig(model="tiny", max_model_len=64, num_threads=1, device="cpu")
    loaded = load_model(config)
    seen = []
    real = sampler.apply_penalties

    def spy(logits, rows):
        seen.append((len(rows.penalty_rows), rows.penalty_tokens.shape))
        return real(logits, rows)

    monkeypatch.setattr(sampler, "apply_penalties", spy)
    with torch.inference_mode():
        profile_sampler(loaded, num_rows=8, seed=0)
    assert seen == [(8, (8, 64))]

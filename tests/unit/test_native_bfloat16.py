"""Proposed: the native kernels on bfloat16 caches against the float64 reference (and the
torch backend in bfloat16), on the ragged batches of test_attention_backends."""

from __future__ import annotations

import pytest
import torch

from mpengine.executor import native_attention
from tests.unit.test_attention_backends import RAGGED, Batch, make_batch, reference, run_torch


def bf16(batch: Batch) -> Batch:
    """The batch rounded to bfloat16, and the same values in float32 (the reference's)."""
    rounded = [t.bfloat16() for t in (batch.query, batch.key, batch.value, batch.cache)]
    exact = Batch(*(t.float() for t in rounded), batch.layout, batch.slot_mapping, batch.scale)
    return Batch(*rounded, batch.layout, batch.slot_mapping, batch.scale), exact


@pytest.mark.parametrize(
    ("group", "head_dim", "block_size"), [(1, 32, 16), (3, 64, 16), (4, 80, 5), (8, 128, 32)]
)
@pytest.mark.parametrize("case", range(len(RAGGED)))
@pytest.mark.parametrize("threads", [1, 2])
def test_native_bfloat16_matches_reference(
    case: int, group: int, head_dim: int, block_size: int, threads: int
) -> None:
    kernels = native_attention.kernels()
    if kernels is None:
        pytest.skip("no C compiler")
    starts, num_tokens = RAGGED[case]
    half, exact = bf16(make_batch(starts, num_tokens, 2, group, head_dim, block_size, seed=case))
    assert kernels.supports(half.cache, 2 * group)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = run_torch(half, workspace=None, native=kernels)
        torch_bf16 = run_torch(half, workspace=None)
    finally:
        torch.set_num_threads(before)
    assert got.dtype == torch.bfloat16
    want = reference(exact)
    # One bfloat16 rounding of the output: half an ulp, 2**-9 relative.
    torch.testing.assert_close(got.double(), want, atol=1e-2, rtol=2**-8)
    # Decode rows: as close to the reference as the torch backend's in bfloat16.
    err_native = (got.double() - want).abs().max()
    err_torch = (torch_bf16.double() - want).abs().max()
    assert err_native <= err_torch * 1.01 + 1e-6, (err_native, err_torch)


def test_native_bfloat16_store_writes_the_rows() -> None:
    kernels = native_attention.kernels()
    if kernels is None:
        pytest.skip("no C compiler")
    cache = torch.zeros(2, 2, 4, 8, 16, dtype=torch.bfloat16)
    key = torch.randn(5, 2, 16).bfloat16().transpose(0, 1)
    value = torch.randn(5, 2, 16).bfloat16().transpose(0, 1)
    slots = torch.tensor([3, -1, 8, 31, 0])
    native_attention.store_kv(cache, slots, key, value)
    flat = cache.view(2, 2, 32, 16)
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert torch.equal(flat[0, :, slot], key[:, t]) and torch.equal(
                flat[1, :, slot], value[:, t]
            )
    assert flat[:, :, [1, 2, 4]].abs().sum() == 0


def test_native_refuses_a_mismatched_dtype() -> None:
    if native_attention.kernels() is None:
        pytest.skip("no C compiler")
    cache = torch.zeros(2, 2, 4, 8, 16, dtype=torch.bfloat16)
    key = torch.randn(2, 1, 16)
    with pytest.raises(TypeError, match=r"float32 tensor for a torch\.bfloat16 cache"):
        native_attention.store_kv(cache, torch.tensor([0]), key, key)

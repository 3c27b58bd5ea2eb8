"""mpengine/executor/linear.py: a packed layer gives F.linear's results (float32 rounding
apart; bit for bit in bfloat16) at every row count, with and without a bias, eagerly and
compiled; install() swaps only plain CPU nn.Linear layers of the dtypes oneDNN packs,
keeping tied weights where they are."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mpengine.executor import linear

ROWS = [1, 2, 3, 4, 5, 8, 16, 64, 257]


def _layer(rows: int, bias: bool, dtype: torch.dtype) -> tuple[torch.nn.Linear, torch.Tensor]:
    gen = torch.Generator().manual_seed(rows)
    layer = torch.nn.Linear(96, 200, bias=bias)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(200, 96, generator=gen))
        if bias:
            layer.bias.copy_(torch.randn(200, generator=gen))
    return layer.to(dtype), torch.randn(1, rows, 96, generator=gen).to(dtype)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("bias", [False, True])
def test_float32_matches_f_linear(threads: int, rows: int, bias: bool) -> None:
    layer, x = _layer(rows, bias, torch.float32)
    want = F.linear(x.double(), layer.weight.double(), None if not bias else layer.bias.double())
    packed = linear.PackedLinear(layer)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = packed(x)
    finally:
        torch.set_num_threads(before)
    assert got.shape == (1, rows, 200) and got.is_contiguous()
    torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-5)


@pytest.mark.skipif(not linear.supported(torch.bfloat16), reason="oneDNN packs no bfloat16 here")
@pytest.mark.parametrize("rows", ROWS)
def test_bfloat16_is_f_linear_bit_for_bit(rows: int) -> None:
    layer, x = _layer(rows, True, torch.bfloat16)
    want = F.linear(x, layer.weight, layer.bias)
    packed = linear.PackedLinear(layer)
    assert packed.dense is None  # only the packed weight is kept
    assert torch.equal(packed(x), want)
    assert torch.equal(packed.weight, layer.weight)  # a dense copy on demand


def test_compiled_layer_uses_the_packed_operator() -> None:
    layer, _ = _layer(5, True, torch.float32)
    packed = linear.PackedLinear(layer)
    compiled = torch.compile(packed, dynamic=True, fullgraph=True)
    with torch.no_grad():
        for rows in (5, 7, 3):
            x = torch.randn(rows, 96)
            torch.testing.assert_close(compiled(x), F.linear(x, layer.weight, layer.bias))


def test_install_swaps_plain_cpu_linears_only() -> None:
    class Head(torch.nn.Linear):  # a subclass keeps its own forward
        pass

    model = torch.nn.Sequential(
        torch.nn.Embedding(10, 8),
        torch.nn.Linear(8, 8),
        torch.nn.Linear(8, 8).half(),
        Head(8, 10, bias=False),
        torch.nn.Linear(8, 10, bias=False),
    )
    model[4].weight = model[0].weight  # tied, as an LM head
    assert linear.install(model) == 2
    assert isinstance(model[1], linear.PackedLinear) and isinstance(model[4], linear.PackedLinear)
    assert type(model[2]) is torch.nn.Linear and type(model[3]) is Head
    assert model[4].weight is model[0].weight  # float32 keeps the dense weight, still tied
    x = torch.randn(3, 8)
    torch.testing.assert_close(model[4](x), F.linear(x, model[0].weight))

"""mpengine/executor/linear.py: W @ x^T for a decode step's few rows gives F.linear's
results (float32 rounding apart), with and without a bias, at every row count and thread
count; install() swaps only plain float32 CPU nn.Linear layers, keeping tied weights."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mpengine.executor import linear


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 16, 64, 256, 257])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_f_linear(threads: int, rows: int, bias: bool) -> None:
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(1, rows, 96, generator=gen)
    weight = torch.randn(200, 96, generator=gen)
    b = torch.randn(200, generator=gen) if bias else None
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = linear.linear(x, weight, b)
    finally:
        torch.set_num_threads(before)
    want = F.linear(x.double(), weight.double(), None if b is None else b.double())
    assert got.shape == (1, rows, 200) and got.is_contiguous()
    torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-5)


def test_install_swaps_plain_float32_linears_only() -> None:
    class Head(torch.nn.Linear):  # a subclass keeps its own forward
        pass

    model = torch.nn.Sequential(
        torch.nn.Embedding(10, 8),
        torch.nn.Linear(8, 8),
        torch.nn.Linear(8, 8).bfloat16(),
        Head(8, 10, bias=False),
        torch.nn.Linear(8, 10, bias=False),
    )
    model[4].weight = model[0].weight  # tied, as an LM head
    assert linear.install(model) == 2
    assert type(model[1]) is not torch.nn.Linear and isinstance(model[1], torch.nn.Linear)
    assert type(model[2]) is torch.nn.Linear and type(model[3]) is Head
    assert model[4].weight is model[0].weight
    x = torch.randn(3, 8)
    torch.testing.assert_close(model[4](x), F.linear(x, model[0].weight))
    assert set(model.state_dict()) == {
        "0.weight",
        "1.weight",
        "1.bias",
        "2.weight",
        "2.bias",
        "3.weight",
        "4.weight",
    }

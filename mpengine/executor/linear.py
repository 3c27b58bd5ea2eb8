"""The model's linear layers on the CPU in float32, over a decode step's few rows.

transformers computes a linear layer as ``x @ W^T`` (``F.linear``). With MKL, the CPU
build's BLAS, that is slow for the few rows of a decode step: one row goes to a
matrix-vector product that streams the weights at about half the memory bandwidth, 2-15
rows go to a path that repacks the weights on every call and runs on one thread, and more
rows still leave a second thread idle much of the time. ``(W @ x^T)^T``, the same products
with the weights as the left operand, splits the weights' rows across threads and streams
them once. Measured on SmolLM2-135M's 211 linear layers (weights cold in memory, as in a
decode step; 2-core AMD EPYC, MKL 2024.2), ms per step:

====  ===============  ===============  ===============  ===============
rows  x @ W^T, 1 thr.  W @ x^T, 1 thr.  x @ W^T, 2 thr.  W @ x^T, 2 thr.
====  ===============  ===============  ===============  ===============
1     46               29 (2 rows)      48               20 (2 rows)
2     79               28               82               32
4     64               47               68               28
8     75               76               72               43
16    98               108              84               58
64    233              234              182              129
====  ===============  ===============  ===============  ===============

Whole decode steps of that model (the executor, interleaved with the old order in one
process): with 2 threads 1.7x faster for 1 sequence, 3x for 2, 2x for 4, 1.3x for 8,
1.1-1.15x for 16-32, alike at 64; with one thread 1.25x, 2.1x and 1.3x for 1, 2 and 4
sequences, alike from 8 on (``W @ x^T`` only wins up to 4 rows there). A single row is
computed as two (itself twice): the product of two rows is a matrix product, faster than
the matrix-vector one. Larger batches (prefill chunks) keep ``F.linear``: the weights are
reused across rows there, and both orders ran alike.

Only the order of the products changes, not their precision: every output is still a
float32 dot product over the same inputs, rounded differently, as a different batch size
already rounds it (greedy tokens stay transformers'; ``tests/e2e``). Other dtypes run on
oneDNN, where ``F.linear`` is the faster order for few rows, and are left alone; so is a
compiled forward (``compile_decode``), whose graphs are not specialised by thread count.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Rows up to which W @ x^T is used: with one thread, and with more.
MAX_ROWS_ONE_THREAD = 4
MAX_ROWS = 256


def weights_first(rows: int, threads: int) -> bool:
    """Whether ``rows`` rows through a float32 linear layer run faster as ``W @ x^T``."""
    return rows <= (MAX_ROWS if threads > 1 else MAX_ROWS_ONE_THREAD)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, as ``W @ x^T`` where :func:`weights_first` says."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if rows == 0:
        return F.linear(x, weight, bias)
    # A compiled forward (decode steps only) always puts the weights first: there,
    # torch.get_num_threads() would break the graph, and a test of the row count would be a
    # guard, each side of it a graph of its own.
    if not torch.compiler.is_compiling() and not weights_first(rows, torch.get_num_threads()):
        return F.linear(x, weight, bias)
    flat = x.reshape(rows, x.shape[-1])
    if rows == 1:
        flat = torch.cat([flat, flat])  # a matrix product, not a matrix-vector one
    if bias is None:
        out = torch.mm(weight, flat.t())
    else:
        out = torch.addmm(bias[:, None], weight, flat.t())
    return out[:, :rows].t().contiguous().view(*x.shape[:-1], weight.shape[0])


class _WeightsFirstLinear(torch.nn.Linear):
    """A :class:`torch.nn.Linear` whose forward is :func:`linear` (same parameters)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return linear(input, self.weight, self.bias)


def install(model: torch.nn.Module) -> int:
    """Route the float32 CPU ``nn.Linear`` layers of ``model`` through :func:`linear`, in
    place (their class changes; parameters, tied weights and state dict keys stay);
    returns how many. Subclasses of ``nn.Linear`` keep their own forward."""
    count = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if (
            type(module) is torch.nn.Linear
            and weight is not None
            and weight.device.type == "cpu"
            and weight.dtype == torch.float32
        ):
            module.__class__ = _WeightsFirstLinear
            count += 1
    return count

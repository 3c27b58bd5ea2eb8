"""The model's linear layers on the CPU, with their weights prepacked by oneDNN.

transformers computes a linear layer as ``F.linear(x, W)``. On the CPU that hands the
weights, stored row-major, to oneDNN (bfloat16) or MKL (float32) on every call, and both
then work on a layout they were not made for: oneDNN reorders the weights into its blocked
layout, MKL repacks them for few rows or streams them at about half the memory bandwidth.
Reordered once at load (``torch.ops.mkldnn._reorder_linear_weight``, what inductor's
freezing does), every call reads the blocked layout straight into oneDNN's matrix kernels.
Measured on SmolLM2-135M's linear layers (weights cold in memory, as in a decode step;
2-core AMD EPYC with AVX512-BF16), ms for 80 layers of 1536 x 576:

=====  ============  ==========  =============  ==========
rows   float32 F.*   f32 packed  bfloat16 F.*   bf16 packed
=====  ============  ==========  =============  ==========
1      10.9 (W x^T)  12.6        12.7           7.6
2      9.6 (W x^T)   14.0        13.8           8.1
4      14.3 (W x^T)  10.2        14.5           6.6
16     37.4 (W x^T)  17.4        18.7           10.2
64     79.0 (W x^T)  47.8        41.4           26.3
=====  ============  ==========  =============  ==========

(``W x^T``: the weights as the left operand, ``(W @ x^T)^T``, which splits the weights' rows
across threads and streams them once.) In float32 that order stays the faster one for one
or two rows (a decode step of one or two sequences, 37 against 43 ms), so a float32 layer
keeps its dense weight for them beside the packed one: twice the memory of its weights, for
the fastest order at every row count. Other dtypes keep only the packed weight. One row is
computed as two (itself twice): the product of two rows is a matrix product, faster than
the matrix-vector one; 3 rows are padded to 4 for oneDNN, whose 4-row kernel is faster.
Whole decode steps of that model at context 256, native attention, 2 threads
(``tools/bench_executor.py``), ms before -> after: bfloat16 40.0 -> 27.7 (1 sequence),
72.8 -> 55.8 (16), 154.6 -> 137.8 (64); float32 98.2 -> 63.5 (16), 247.5 -> 192.3 (64),
mixed steps 499 -> 350.

The results are bit-identical to ``F.linear`` in bfloat16 (the same oneDNN kernels, once
reordered) and differ in float32 rounding only, as another batch size already rounds them
(greedy tokens stay transformers'; ``tests/e2e``). Where the dense weight is dropped,
``weight`` gives a dense copy back; an LM head tied to the embeddings keeps it there. Under
``torch.compile`` (``compile_decode``) a layer is the ``mpengine::packed_linear`` operator,
opaque to inductor, so compiled decode steps use the packed weights too.
"""

from __future__ import annotations

import torch

# float32 rows up to this many go through the dense weight, as W @ x^T; rows below
# MIN_PACKED_ROWS are padded to it for the packed one (oneDNN's few-row kernels are slower).
MAX_DENSE_ROWS = 2
MIN_PACKED_ROWS = 4

_LIBRARY = torch.library.Library("mpengine", "FRAGMENT")


def supported(dtype: torch.dtype) -> bool:
    """Whether oneDNN on this CPU packs weights of ``dtype`` (bfloat16 needs AVX512 or
    better; float16 needs AVX512-FP16 or AVX-NE-CONVERT, and is left to ``F.linear``)."""
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.float32:
        return True
    return dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, W, bias)`` for ``packed``, ``W`` as :class:`PackedLinear` packs it."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if 0 < rows < MIN_PACKED_ROWS and x.dtype == torch.float32:
        flat = x.reshape(rows, x.shape[-1])
        padded = torch.cat([flat, flat.new_zeros(MIN_PACKED_ROWS - rows, x.shape[-1])])
        out = torch.ops.mkldnn._linear_pointwise(padded, packed, bias, "none", [], "")
        return out[:rows].view(*x.shape[:-1], out.shape[-1])
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def weights_first(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` as ``(W @ x^T)^T``; one row is computed as two."""
    rows = x.numel() // x.shape[-1]
    flat = x.reshape(rows, x.shape[-1])
    if rows == 1:
        flat = torch.cat([flat, flat])  # a matrix product, not a matrix-vector one
    if bias is None:
        out = torch.mm(weight, flat.t())
    else:
        out = torch.addmm(bias[:, None], weight, flat.t())
    return out[:, :rows].t().contiguous().view(*x.shape[:-1], weight.shape[0])


# The operator a compiled forward calls: inductor cannot lower the mkldnn operator with a
# packed weight, but calls an operator it does not know as it is (``out_features`` gives
# the fake implementation its shape). The packed weight makes the dispatch key MkldnnCPU.
_LIBRARY.define("packed_linear(Tensor x, Tensor packed, Tensor? bias, int out_features) -> Tensor")
for _key in ("CPU", "MkldnnCPU"):
    _LIBRARY.impl("packed_linear", lambda x, packed, bias, _: packed_linear(x, packed, bias), _key)
torch.library.register_fake(
    "mpengine::packed_linear",
    lambda x, packed, bias, out_features: x.new_empty(*x.shape[:-1], out_features),
    lib=_LIBRARY,
)


class PackedLinear(torch.nn.Module):
    """An ``nn.Linear`` whose weight oneDNN has packed; the bias stays a parameter, and so
    does the dense weight in float32 (as ``dense``), for one or two rows."""

    def __init__(self, layer: torch.nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = layer.in_features, layer.out_features
        self.packed = torch.ops.mkldnn._reorder_linear_weight(layer.weight.detach(), None)
        self.bias = layer.bias
        self.dense = layer.weight if layer.weight.dtype == torch.float32 else None

    @property
    def weight(self) -> torch.Tensor:
        """The weight, dense (a copy where the layer keeps only the packed one)."""
        return self.dense if self.dense is not None else self.packed.to_dense()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return torch.ops.mpengine.packed_linear(x, self.packed, self.bias, self.out_features)
        if self.dense is not None and 0 < x.numel() <= MAX_DENSE_ROWS * x.shape[-1]:
            return weights_first(x, self.dense, self.bias)
        return packed_linear(x, self.packed, self.bias)

    def extra_repr(self) -> str:
        dense = ", dense" if self.dense is not None else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, packed{dense}"


def install(model: torch.nn.Module) -> int:
    """Replace the plain CPU ``nn.Linear`` layers of ``model`` whose dtype oneDNN packs by
    :class:`PackedLinear`, in place; returns how many. Subclasses of ``nn.Linear`` keep
    their own forward."""
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            weight = getattr(child, "weight", None)
            if (
                type(child) is torch.nn.Linear
                and weight is not None
                and weight.device.type == "cpu"
                and supported(weight.dtype)
            ):
                setattr(parent, name, PackedLinear(child))
                count += 1
    return count

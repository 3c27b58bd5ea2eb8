"""The attention backends against plain per-sequence causal attention, on ragged batches.

A batch mixes decodes (one new token) with prefill chunks of up to ~600 tokens that start
at position 0 or continue a cached context; contexts cross block boundaries, the blocks of
each sequence are shuffled across the cache, and query heads share KV heads 1, 2, 4 or 8
to one. The reference gathers each sequence's whole context and runs dense causal
attention in float64. The Triton kernels run under the interpreter (``TRITON_INTERPRET=1``)
on small shapes: it executes every program instance in numpy.
"""

from __future__ import annotations

import importlib
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

import mpengine.executor.native_attention as native_attention
import mpengine.executor.torch_attention as torch_attention
from mpengine.executor.attention import METADATA_KWARG, StepLayout
from mpengine.executor.paged_attention import (
    AttentionMetadata,
    build_metadata,
    paged_attention_forward,
)

TOLERANCE = 1e-5


@dataclass
class Batch:
    """A step: new tokens' queries/keys/values in transformers' layout, a cache already
    holding every earlier token, and the step's layout and index arrays."""

    query: torch.Tensor  # [1, heads, T, dim] (a transposed view, as transformers passes it)
    key: torch.Tensor  # [1, kv_heads, T, dim]
    value: torch.Tensor
    cache: torch.Tensor  # [2, kv_heads, blocks, block_size, dim]
    layout: StepLayout
    slot_mapping: np.ndarray  # [T]
    scale: float


def make_batch(
    starts: list[int],
    num_tokens: list[int],
    kv_heads: int,
    group: int,
    head_dim: int,
    block_size: int,
    seed: int = 0,
) -> Batch:
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    starts_a, n = np.asarray(starts, np.int64), np.asarray(num_tokens, np.int64)
    contexts = starts_a + n
    blocks_per_seq = -(-contexts // block_size)
    num_blocks = int(blocks_per_seq.sum()) + 3  # a few blocks nobody owns
    width = int(blocks_per_seq.max()) + 1  # a column past every context: unset (-1)
    owned = rng.permutation(num_blocks)
    table = np.full((len(n), width), -1, np.int32)
    offset = 0
    for i, count in enumerate(blocks_per_seq):
        table[i, :count] = owned[offset : offset + count]
        offset += count
    cache = torch.randn(2, kv_heads, num_blocks, block_size, head_dim, generator=gen)
    total = int(n.sum())
    first = np.cumsum(n) - n
    positions = np.arange(total) - np.repeat(first, n) + np.repeat(starts_a, n)
    seq = np.repeat(np.arange(len(n)), n)
    slots = table[seq, positions // block_size].astype(np.int64) * block_size
    slots += positions % block_size
    heads = kv_heads * group

    def transformers_layout(num: int) -> torch.Tensor:
        return torch.randn(1, total, num, head_dim, generator=gen).transpose(1, 2)

    return Batch(
        query=transformers_layout(heads),
        key=transformers_layout(kv_heads),
        value=transformers_layout(kv_heads),
        cache=cache,
        layout=StepLayout(starts=starts_a, num_tokens=n, block_table=table, block_size=block_size),
        slot_mapping=slots,
        scale=head_dim**-0.5,
    )


def reference(batch: Batch) -> torch.Tensor:
    """Dense causal attention per sequence over its gathered context, in float64."""
    cache = batch.cache.double().clone()
    kv_heads, bs, dim = cache.shape[1], cache.shape[3], cache.shape[4]
    flat = cache.view(2, kv_heads, -1, dim)
    rows = torch.from_numpy(batch.slot_mapping)
    flat[0, :, rows] = batch.key[0].double()
    flat[1, :, rows] = batch.value[0].double()
    query = batch.query[0].double()  # [heads, T, dim]
    group = query.shape[0] // kv_heads
    outputs, first = [], 0
    for start, n, row in zip(
        batch.layout.starts, batch.layout.num_tokens, batch.layout.block_table, strict=True
    ):
        context = int(start + n)
        pos = np.arange(context)
        index = torch.from_numpy(row[pos // bs].astype(np.int64) * bs + pos % bs)
        keys = flat[0][:, index].repeat_interleave(group, 0)  # [heads, L, dim]
        values = flat[1][:, index].repeat_interleave(group, 0)
        q = query[:, first : first + n]
        scores = q @ keys.transpose(1, 2) * batch.scale
        query_pos = torch.arange(start, start + n)[:, None]
        scores = scores.masked_fill(torch.from_numpy(pos)[None, :] > query_pos, float("-inf"))
        outputs.append((scores.softmax(-1) @ values).transpose(0, 1))  # [n, heads, dim]
        first += n
    return torch.cat(outputs)


# Shared by every case: a reused gather buffer must not leak one batch into another.
WORKSPACE = torch_attention.Workspace()


def run_torch(
    batch: Batch,
    workspace: torch_attention.Workspace | None = WORKSPACE,
    native: native_attention.Kernels | None = None,
) -> torch.Tensor:
    plan = torch_attention.plan_step(batch.layout, batch.cache, workspace, native)
    cache = batch.cache.clone()
    out = torch_attention.attend(
        plan,
        cache,
        torch.from_numpy(batch.slot_mapping),
        batch.query,
        batch.key,
        batch.value,
        batch.scale,
    )
    return out


# (starts, new tokens): decodes beside chunks that start at 0 or continue a context.
RAGGED = [
    ([37, 0, 5, 120, 0], [1, 23, 1, 40, 1]),
    ([0], [600]),
    ([100, 3, 0, 64, 250], [1, 1, 311, 1, 57]),
    ([15, 31, 47, 2], [1, 1, 1, 1]),
    ([0, 200], [600, 1]),
]


@pytest.mark.parametrize("decodes", ["padded", "chunks of 1", "chunks of 8"])
@pytest.mark.parametrize(
    ("group", "head_dim", "block_size"), [(1, 32, 16), (2, 64, 16), (4, 80, 5), (8, 128, 32)]
)
@pytest.mark.parametrize("case", range(len(RAGGED)))
def test_torch_backend_matches_reference(
    case: int, group: int, head_dim: int, block_size: int, decodes: str, monkeypatch
) -> None:
    ratio = float("inf") if decodes == "padded" else 0.0
    monkeypatch.setattr(torch_attention, "CHUNKED_PADDING_RATIO", ratio)
    monkeypatch.setattr(torch_attention, "MAX_CHUNK_BLOCKS", 1 if decodes == "chunks of 1" else 8)
    starts, num_tokens = RAGGED[case]
    batch = make_batch(starts, num_tokens, 2, group, head_dim, block_size, seed=case)
    torch.testing.assert_close(
        run_torch(batch).double(), reference(batch), atol=TOLERANCE, rtol=TOLERANCE
    )


@pytest.mark.parametrize("decodes", ["padded", "chunks of 8"])
def test_float16_decodes_scale_before_they_overflow(decodes: str, monkeypatch) -> None:
    """q.k can pass float16's 65504 before the scale (here its spread is ~1e5 before, ~1.6e3
    after): the decodes multiplied first and gave inf and NaN; prefill (SDPA) did not."""
    ratio = float("inf") if decodes == "padded" else 0.0
    monkeypatch.setattr(torch_attention, "CHUNKED_PADDING_RATIO", ratio)
    batch = make_batch([20, 7], [1, 1], 1, 2, 64, 8, seed=5)
    batch.query.mul_(80.0)
    batch.key.mul_(160.0)
    batch.cache[0].mul_(160.0)
    batch.scale = 1 / 64
    half = Batch(
        batch.query.half(),
        batch.key.half(),
        batch.value.half(),
        batch.cache.half(),
        batch.layout,
        batch.slot_mapping,
        batch.scale,
    )
    out = run_torch(half, workspace=None)
    assert out.isfinite().all()
    torch.testing.assert_close(out.double(), reference(batch), atol=0.05, rtol=0.05)


@pytest.mark.parametrize("backend", ["torch", "native"])
@pytest.mark.parametrize("decodes", ["padded", "chunks of 8"])
@pytest.mark.parametrize("case", [i for i, (starts, _) in enumerate(RAGGED) if len(starts) > 1])
def test_one_sequence_non_finite_keys_stay_its_own(
    case: int, decodes: str, backend: str, monkeypatch
) -> None:
    """Unset table entries were read as block 0, another sequence's; masked scores do not
    keep NaN out (-inf + NaN, 0 x NaN), so the NaN key that block's owner wrote made other
    sequences' outputs NaN. Padding now reads a sequence's own first block."""
    ratio = float("inf") if decodes == "padded" else 0.0
    monkeypatch.setattr(torch_attention, "CHUNKED_PADDING_RATIO", ratio)
    starts, num_tokens = RAGGED[case]
    batch = make_batch(starts, num_tokens, 2, 2, 64, 16, seed=case)
    owner = next((i for i, row in enumerate(batch.layout.block_table) if 0 in row), None)
    assert owner is not None, "block 0 is nobody's in this layout"
    first = np.cumsum(num_tokens) - np.asarray(num_tokens)
    batch.key[0, :, first[owner]] = float("nan")  # block 0's owner writes a NaN key
    kernels = native_attention.kernels() if backend == "native" else None
    if backend == "native" and kernels is None:
        pytest.skip("no C compiler: no native kernels")
    want, got = reference(batch), run_torch(batch, native=kernels).double()
    others = [i for i in range(len(num_tokens)) if i != owner]
    assert got[first[owner]].isnan().all()
    for i in others:
        rows = slice(int(first[i]), int(first[i] + num_tokens[i]))
        torch.testing.assert_close(got[rows], want[rows], atol=TOLERANCE, rtol=TOLERANCE)


@pytest.fixture(scope="module")
def kernels() -> native_attention.Kernels:
    lib = native_attention.kernels()
    if lib is None:
        pytest.skip("no C compiler: the native kernels cannot be built here")
    return lib


@pytest.mark.parametrize(
    ("group", "head_dim", "block_size"),
    [(1, 32, 16), (2, 64, 16), (4, 80, 5), (8, 128, 32), (16, 96, 128), (2, 40, 16)],
)
@pytest.mark.parametrize("case", range(len(RAGGED)))
def test_native_backend_matches_reference(
    kernels: native_attention.Kernels, case: int, group: int, head_dim: int, block_size: int
) -> None:
    starts, num_tokens = RAGGED[case]
    batch = make_batch(starts, num_tokens, 2, group, head_dim, block_size, seed=case)
    plan = torch_attention.plan_step(batch.layout, batch.cache, WORKSPACE, kernels)
    assert plan.native is kernels
    if 1 in num_tokens:
        assert isinstance(plan.decode, torch_attention.NativeDecodePlan)
    torch.testing.assert_close(
        run_torch(batch, native=kernels).double(), reference(batch), atol=TOLERANCE, rtol=TOLERANCE
    )


@pytest.mark.parametrize(("group", "head_dim", "block_size"), [(2, 32, 16), (4, 64, 32), (3, 8, 5)])
def test_native_decode_ignores_rows_past_the_context(
    kernels: native_attention.Kernels, group: int, head_dim: int, block_size: int
) -> None:
    """Scores come 16 keys at a time, reading a block's rows past the context too: NaN
    there (and in blocks nobody owns) must not reach any output."""
    starts = [0, 5, 15, 16, 31, 47, 100]
    batch = make_batch(starts, [1] * len(starts), 2, group, head_dim, block_size, seed=3)
    flat = batch.cache.view(2, 2, -1, head_dim)
    live = np.zeros(flat.shape[2], bool)
    for start, row in zip(starts, batch.layout.block_table, strict=True):
        pos = np.arange(start)  # the step writes position ``start`` itself
        live[row[pos // block_size].astype(np.int64) * block_size + pos % block_size] = True
    flat[:, :, torch.from_numpy(~live)] = float("nan")
    out = run_torch(batch, native=kernels)
    assert not out.isnan().any()
    torch.testing.assert_close(out.double(), reference(batch), atol=TOLERANCE, rtol=TOLERANCE)


@pytest.mark.parametrize("threads", [1, 2])
def test_native_decodes_long_and_uneven(kernels: native_attention.Kernels, threads: int) -> None:
    """Contexts from 1 key to ~2,000 in one step, with the OpenMP work split across
    threads: every decode reads exactly its own keys."""
    starts = [0, 1, 15, 16, 17, 2047, 600, 33, 1000, 0]
    batch = make_batch(starts, [1] * len(starts), 4, 2, 64, 16, seed=7)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = run_torch(batch, native=kernels)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(out.double(), reference(batch), atol=TOLERANCE, rtol=TOLERANCE)


def test_native_store_skips_negative_slots(kernels: native_attention.Kernels) -> None:
    """A negative slot (a padding row) writes nothing; the others land in their rows, from
    strided keys and values."""
    cache = torch.zeros(2, 2, 4, 8, 16)
    key = torch.randn(5, 2, 16).transpose(0, 1)  # [kv_heads, T, dim], not contiguous
    value = torch.randn(5, 2, 16).transpose(0, 1)
    slots = torch.tensor([3, -1, 8, 31, 0])
    native_attention.store_kv(cache, slots, key, value)
    flat = cache.view(2, 2, 32, 16)
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            torch.testing.assert_close(flat[0, :, slot], key[:, t])
            torch.testing.assert_close(flat[1, :, slot], value[:, t])
    written = {s for s in slots.tolist() if s >= 0}
    untouched = [r for r in range(32) if r not in written]
    assert flat[:, :, untouched].abs().sum() == 0


def test_native_kernels_are_cached(tmp_path, monkeypatch) -> None:
    """The library is built once per source, compiler and CPU, then found in the cache."""
    monkeypatch.setenv("MPENGINE_CACHE_DIR", str(tmp_path))
    if shutil.which(os.environ.get("CC") or "cc") is None:
        pytest.skip("no C compiler")
    first = native_attention._library_path()
    assert first.parent == tmp_path / "kernels" and first.exists()
    mtime = first.stat().st_mtime_ns
    assert native_attention._library_path() == first
    assert first.stat().st_mtime_ns == mtime
    names = sorted(p.name for p in first.parent.iterdir())  # no temporary left
    assert names == sorted([first.name, first.with_suffix(".sha256").name])


def test_a_damaged_cached_library_is_built_again(tmp_path, monkeypatch) -> None:
    """Loading a truncated library would crash the process: its digest gives it away."""
    monkeypatch.setenv("MPENGINE_CACHE_DIR", str(tmp_path))
    if shutil.which(os.environ.get("CC") or "cc") is None:
        pytest.skip("no C compiler")
    path = native_attention._library_path()
    good = path.read_bytes()
    path.write_bytes(good[:1000])
    assert native_attention._library_path() == path
    assert path.read_bytes() == good


def test_compilers_with_arguments_and_compilers_that_write_nothing(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("MPENGINE_CACHE_DIR", str(tmp_path))
    if shutil.which("cc") is None:
        pytest.skip("no C compiler")
    monkeypatch.setenv("CC", "cc -w")
    assert native_attention._library_path().stat().st_size > 0
    monkeypatch.setenv("MPENGINE_CACHE_DIR", str(tmp_path / "other"))
    monkeypatch.setenv("CC", "true")  # exits 0, writes no library
    with pytest.raises(OSError, match="no library"):
        native_attention._library_path()
    assert not list((tmp_path / "other" / "kernels").glob("*.so"))


def test_too_many_query_heads_fail_before_the_cache_is_written(kernels) -> None:
    batch = make_batch([3, 10], [1, 1], 1, kernels.max_group + 1, 8, 16)
    plan = torch_attention.plan_step(batch.layout, batch.cache, WORKSPACE, kernels)
    cache = batch.cache.clone()
    slots = torch.from_numpy(batch.slot_mapping)
    with pytest.raises(NotImplementedError, match="query heads per KV head"):
        torch_attention.attend(plan, cache, slots, batch.query, batch.key, batch.value, None)
    assert torch.equal(cache, batch.cache)


def test_native_kernels_unavailable_without_a_compiler(tmp_path, monkeypatch, caplog) -> None:
    monkeypatch.setenv("MPENGINE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", "no-such-compiler")
    native_attention.kernels.cache_clear()
    try:
        assert native_attention.kernels() is None
        assert "no C compiler" in caplog.text
    finally:
        native_attention.kernels.cache_clear()


def test_uneven_decodes_pick_the_chunked_layout() -> None:
    """One long decode among short ones reads each sequence's blocks, not padded rows."""
    uneven = make_batch([1000] + [20] * 15, [1] * 16, 2, 2, 32, 16)
    assert torch_attention.plan_step(uneven.layout, uneven.cache).decode.seq_of_chunk is not None
    even = make_batch([500] * 16, [1] * 16, 2, 2, 32, 16)
    assert torch_attention.plan_step(even.layout, even.cache).decode.seq_of_chunk is None


class _Layer(torch.nn.Module):
    layer_idx = 0


def metadata_for(batch: Batch, backend: str, cache: torch.Tensor) -> AttentionMetadata:
    layout = batch.layout
    cu_seqlens = np.concatenate([[0], np.cumsum(layout.num_tokens)])

    def to(array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(array).to(cache.device)

    return build_metadata(
        backend,  # type: ignore[arg-type]
        layout,
        [cache],
        to(batch.slot_mapping),
        to(cu_seqlens),
        to(layout.starts + layout.num_tokens),
        to(layout.block_table),
    )


def test_registered_function_dispatches_and_checks() -> None:
    batch = make_batch(*RAGGED[0], 2, 2, 32, 16)
    cache = batch.cache.clone()
    metadata = metadata_for(batch, "torch", cache)
    assert metadata.max_context == 160 and not metadata.decode_only
    out, _ = paged_attention_forward(
        _Layer(),
        batch.query,
        batch.key,
        batch.value,
        None,
        batch.scale,
        **{METADATA_KWARG: metadata},
    )
    assert out.shape == (1, 66, 4, 32)
    torch.testing.assert_close(out[0].double(), reference(batch), atol=TOLERANCE, rtol=TOLERANCE)
    with pytest.raises(NotImplementedError, match="sliding window"):
        paged_attention_forward(
            _Layer(),
            batch.query,
            batch.key,
            batch.value,
            None,
            sliding_window=64,
            **{METADATA_KWARG: metadata},
        )
    with pytest.raises(RuntimeError, match="needs the"):
        paged_attention_forward(_Layer(), batch.query, batch.key, batch.value, None)


# -- triton ----------------------------------------------------------------------------------
# On a GPU the kernels run compiled. On the CPU they run under the interpreter, which only
# works if TRITON_INTERPRET=1 is set before triton is first imported (torch imports it
# early when it is installed): test_triton_under_the_interpreter runs them in a child
# pytest with that environment.

TRITON_TESTS = "triton_backend or triton_store or triton_dispatch"


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


@pytest.fixture(scope="module")
def triton_attention():
    """(the Triton module, the device its kernels run on)."""
    pytest.importorskip("triton", reason="triton is not installed (the test extra has it)")
    if not torch.cuda.is_available() and not _interpreted():
        pytest.skip("runs in a child process under the interpreter (see the test below)")
    module = importlib.import_module("mpengine.executor.triton_attention")
    return module, torch.device("cuda" if torch.cuda.is_available() else "cpu")


def test_triton_under_the_interpreter() -> None:
    pytest.importorskip("triton", reason="triton is not installed (the test extra has it)")
    if torch.cuda.is_available() or _interpreted():
        pytest.skip("the Triton tests run in this process")
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", TRITON_TESTS]
    done = subprocess.run(
        [*command, str(Path(__file__).resolve())],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    assert done.returncode == 0 and "passed" in summary and "skipped" not in summary, (
        f"{summary}\n{done.stdout[-4000:]}\n{done.stderr[-2000:]}"
    )


# Small shapes: the interpreter runs each program instance in numpy.
TRITON_CASES = [
    ([9, 0, 3, 21], [1, 7, 1, 5], 2, 1, 32, 4),
    ([0, 30], [40, 1], 1, 2, 32, 16),
    ([5, 17, 0], [1, 1, 19], 2, 4, 64, 8),
    ([2, 0], [1, 12], 1, 8, 128, 16),
    ([11, 0, 6], [3, 9, 1], 2, 2, 80, 5),
]


@pytest.mark.parametrize("case", TRITON_CASES)
def test_triton_backend_matches_reference(triton_attention, case) -> None:
    module, device = triton_attention
    starts, num_tokens, kv_heads, group, head_dim, block_size = case
    batch = make_batch(starts, num_tokens, kv_heads, group, head_dim, block_size, seed=3)
    cache = batch.cache.to(device)
    layout = batch.layout

    def to(array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(array).to(device)

    module.store_kv(
        batch.key[0].to(device), batch.value[0].to(device), cache, to(batch.slot_mapping)
    )
    out = module.paged_attention(
        batch.query[0].transpose(0, 1).to(device),
        cache,
        to(layout.block_table),
        to(layout.starts + layout.num_tokens),
        to(np.concatenate([[0], np.cumsum(layout.num_tokens)])),
        batch.scale,
        decode_only=bool((layout.num_tokens == 1).all()),
    )
    expected = reference(batch)
    torch.testing.assert_close(out.cpu().double(), expected, atol=TOLERANCE, rtol=TOLERANCE)
    torch.testing.assert_close(cache.cpu(), _stored(batch), atol=0, rtol=0)
    # The torch backend agrees too (the two are interchangeable under one metadata).
    torch.testing.assert_close(run_torch(batch).double(), expected, atol=TOLERANCE, rtol=TOLERANCE)


def _stored(batch: Batch) -> torch.Tensor:
    cache = batch.cache.clone()
    kv_heads, dim = cache.shape[1], cache.shape[4]
    rows = torch.from_numpy(batch.slot_mapping)
    cache[0].view(kv_heads, -1, dim)[:, rows] = batch.key[0]
    cache[1].view(kv_heads, -1, dim)[:, rows] = batch.value[0]
    return cache


def test_triton_store_skips_padding_rows(triton_attention) -> None:
    module, device = triton_attention
    batch = make_batch([0], [6], 2, 1, 32, 4)
    cache = batch.cache.to(device)
    slots = torch.from_numpy(batch.slot_mapping).clone()
    slots[3] = -1  # a padding row of a captured batch: nothing is stored
    module.store_kv(batch.key[0].to(device), batch.value[0].to(device), cache, slots.to(device))
    cache = cache.cpu()
    expected = _stored(batch)
    row = int(batch.slot_mapping[3])
    kv_heads, dim = cache.shape[1], cache.shape[4]
    expected.view(2, kv_heads, -1, dim)[:, :, row] = batch.cache.view(2, kv_heads, -1, dim)[
        :, :, row
    ]
    torch.testing.assert_close(cache, expected, atol=0, rtol=0)


def test_triton_dispatch_through_the_registered_function(triton_attention) -> None:
    _, device = triton_attention
    batch = make_batch([9, 0, 3], [1, 7, 1], 2, 2, 32, 4)
    cache = batch.cache.to(device)
    metadata = metadata_for(batch, "triton", cache)
    q, k, v = (t.to(device) for t in (batch.query, batch.key, batch.value))
    out, _ = paged_attention_forward(
        _Layer(), q, k, v, None, batch.scale, **{METADATA_KWARG: metadata}
    )
    expected = reference(batch)
    torch.testing.assert_close(out[0].cpu().double(), expected, atol=TOLERANCE, rtol=TOLERANCE)


def test_triton_kernels_compile_for_a_gpu() -> None:
    """The kernels as a GPU would build them (Triton to PTX to an sm_90 binary, no GPU
    needed): a kernel only ever run by the interpreter could still fail to compile."""
    pytest.importorskip("triton", reason="triton is not installed (the test extra has it)")
    if _interpreted():
        pytest.skip("the kernels are interpreted in this process")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    module = importlib.import_module("mpengine.executor.triton_attention")
    import triton

    def build(kernel, types: dict[str, str], constants: dict[str, object]) -> None:
        names = kernel.arg_names
        signature = {
            name: "constexpr" if name in constants else types.get(name, "i64") for name in names
        }
        source = ASTSource(
            fn=kernel,
            signature=signature,
            constexprs={(names.index(k),): v for k, v in constants.items()},
        )
        try:
            triton.compile(source, target=GPUTarget("cuda", 90, 32))
        except (FileNotFoundError, PermissionError) as exc:  # no ptxas in this triton build
            pytest.skip(f"triton cannot build for a GPU here: {exc}")

    # bfloat16 (a GPU's default dtype): decode and prefill shapes, and the store; float32:
    # the decode shape with exact (IEEE) dot products.
    for dtype, precision, shapes in (
        ("bf16", "tf32", ((16, 8), (64, 32))),
        ("fp32", "ieee", ((16, 8),)),
    ):
        pointers = {"block_table_ptr": "*i32", "num_seqs": "i32", "scale": "fp32"}
        pointers |= {p: f"*{dtype}" for p in ("out_ptr", "query_ptr", "cache_ptr")}
        pointers |= {"seq_lens_ptr": "*i64", "cu_seqlens_q_ptr": "*i64"}
        for block_m, block_q in shapes:
            constants = dict(NUM_HEADS=16, GROUP=2, HEAD_DIM=128, HEAD_DIM_P2=128)
            constants |= dict(BLOCK_SIZE=16, BLOCK_Q=block_q, BLOCK_M=block_m, TILE_N=32)
            build(
                module._paged_attention_kernel, pointers, {**constants, "DOT_PRECISION": precision}
            )
    store = {p: "*bf16" for p in ("key_ptr", "value_ptr", "cache_ptr")}
    store |= {"slot_mapping_ptr": "*i64", "num_tokens": "i32"}
    constants = dict(NUM_KV_HEADS=8, HEAD_DIM=128, KV_HEADS_P2=8, HEAD_DIM_P2=128)
    build(module._store_kv_kernel, store, {**constants, "BLOCK_SIZE": 16, "TOKENS": 4})


def test_triton_under_the_interpreter_refuses_bfloat16(monkeypatch) -> None:
    """The interpreter's tl.dot is wrong for bfloat16 inputs (a 16 x 16 dot off by 1e10):
    the engine served nonsense with no error. float32 and float16 run."""
    from mpengine.executor.attention import choose_backend

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    cpu = torch.device("cpu")
    for dtype in (torch.float32, torch.float16):
        cache = torch.empty((2, 2, 0, 16, 64), dtype=dtype)
        assert choose_backend("triton", cpu, cache, 4) == "triton"
    cache = torch.empty((2, 2, 0, 16, 64), dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="cannot compute in bfloat16"):
        choose_backend("triton", cpu, cache, 4)

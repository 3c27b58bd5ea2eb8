"""The ``native`` CPU backend's kernels: ``csrc/paged_attention.c``, built on first use.

The torch backend's decode attention gathers every sequence's blocks into a padded copy,
then reads the copy twice (scores, then values): on the CPU its decode steps are
memory-bound, and the copy is most of their cost. The C kernel reads the blocks in place
through the block table, once, with the softmax kept online (measured 1.7-2.2x the torch
decode attention on one thread, 64 decodes of 128 keys; ``tools/bench_executor.py``). It
also writes a step's keys and values into the cache (one ``memcpy`` per token and head
instead of two ``index_copy_`` calls).

The library is compiled with the system's C compiler (``$CC``, else ``cc``) for this
machine's CPU (``-march=native``) and kept under :func:`mpengine.envs.cache_dir`, keyed by
the source, the compiler and the CPU, so a machine builds it once (~1 s). Without a
compiler, or if the build fails, :func:`kernels` is ``None`` and the CPU default is the
torch backend. Prefill chunks keep the torch backend's SDPA call, whose blocked kernel
suits long queries.

float32 and bfloat16 caches use the kernels (bfloat16 is widened to float32 as it is read;
see the C file). A model run in bfloat16 on the CPU otherwise fell back to the torch
backend, whose padded gathers of its blocks took 16 % of SmolLM2-135M's decode step (64
sequences at context 128, one thread): its decode steps ran 1.03-1.1x faster with the
kernels (1-64 sequences at context 136).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import logging
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from mpengine.envs import cache_dir, write_atomically

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "paged_attention.c"
FLAGS = ["-O3", "-fopenmp", "-fno-math-errno", "-fno-trapping-math", "-shared", "-fPIC"]
ARCH_FLAGS = ["-march=native"]  # dropped when the compiler refuses it

_I64, _PTR = ctypes.c_int64, ctypes.c_void_p


# The kernels' entry points by cache dtype (their suffix in the library).
DTYPES = {torch.float32: "f32", torch.bfloat16: "bf16"}


class Kernels:
    """The loaded library's entry points (by cache dtype), with their limits."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.stores: dict[torch.dtype, Callable[..., None]] = {}
        self.decodes: dict[torch.dtype, Callable[..., None]] = {}
        for dtype, suffix in DTYPES.items():
            store = getattr(lib, f"mpengine_store_kv_{suffix}")
            store.argtypes = [_PTR, _I64, _I64, _PTR, _I64, _I64, _PTR, _I64, _PTR]
            store.argtypes += [_I64] * 7
            store.restype = None
            decode = getattr(lib, f"mpengine_decode_attention_{suffix}")
            decode.argtypes = [_PTR, _I64, _I64, _PTR, _PTR, _I64, _I64, _I64, _I64, _PTR]
            decode.argtypes += [_I64, _PTR] + [_I64] * 5 + [ctypes.c_float, _PTR, _I64, _I64]
            decode.argtypes += [ctypes.c_int]
            decode.restype = None
            self.stores[dtype], self.decodes[dtype] = store, decode
        for name in ("mpengine_max_group", "mpengine_max_head_dim", "mpengine_max_block_size"):
            getattr(lib, name).restype = _I64
        self.max_group = lib.mpengine_max_group()
        self.max_head_dim = lib.mpengine_max_head_dim()
        self.max_block_size = lib.mpengine_max_block_size()

    def supports(self, cache: torch.Tensor, num_heads: int) -> bool:
        """Whether the kernels handle this layer cache ``[2, kv_heads, blocks, block_size,
        head_dim]`` and ``num_heads`` query heads."""
        _, kv_heads, _, block_size, head_dim = cache.shape
        return (
            cache.device.type == "cpu"
            and cache.dtype in DTYPES
            and cache.stride(-1) == 1
            and head_dim <= self.max_head_dim
            and block_size <= self.max_block_size
            and num_heads % kv_heads == 0
            and num_heads // kv_heads <= self.max_group
        )


@functools.cache
def kernels() -> Kernels | None:
    """The kernels, built or found in the cache on first call; ``None`` when they cannot be
    built here (logged once)."""
    try:
        # torch has loaded its libgomp.so.1 already: the library's OpenMP binds to that one.
        return Kernels(ctypes.CDLL(str(_library_path())))
    except (OSError, AttributeError, subprocess.SubprocessError) as exc:
        logger.warning("native CPU attention kernels unavailable: %s", exc)
        return None


def _library_path() -> Path:
    compiler = shlex.split(os.environ.get("CC") or "cc")
    if not compiler or shutil.which(compiler[0]) is None:
        raise OSError(f"no C compiler ({os.environ.get('CC') or 'cc'!r} is not on PATH)")
    version = subprocess.run(
        [*compiler, "--version"], capture_output=True, text=True, check=True, timeout=30
    ).stdout
    key = hashlib.sha256()
    for part in (SOURCE.read_bytes(), version.encode(), " ".join(FLAGS).encode(), _cpu_id()):
        key.update(part)
    path = cache_dir() / "kernels" / f"paged_attention-{key.hexdigest()[:16]}.so"
    # The library's own digest beside it: a damaged file (a truncated library crashes the
    # process that loads it, with no exception to catch) is built again instead.
    digest = path.with_suffix(".sha256")
    with contextlib.suppress(OSError):
        if digest.read_text() == _digest(path):
            return path
    path.parent.mkdir(parents=True, exist_ok=True)
    # Built beside its final name, then renamed: processes that build at once each write
    # their own file, and the last rename wins with an identical library.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
    os.close(fd)
    try:
        errors = ""
        for arch in (ARCH_FLAGS, []):
            cmd = [*compiler, *FLAGS, *arch, "-o", tmp, str(SOURCE)]
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
            if done.returncode == 0 and os.path.getsize(tmp) > 0:
                write_atomically(digest, _digest(Path(tmp)).encode())
                os.replace(tmp, path)
                logger.info("built %s", path)
                return path
            errors = done.stderr.strip() or f"exit status {done.returncode}, no library"
        raise OSError(f"{' '.join(compiler)} failed: {errors[-2000:]}")
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _cpu_id() -> bytes:
    """What ``-march=native`` compiles for: the architecture and the CPU's feature flags."""
    ident = platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features", "model name")):
                    ident += line
    except OSError:
        pass
    return ident.encode()


def store_kv(
    cache: torch.Tensor, slot_mapping: torch.Tensor, key: torch.Tensor, value: torch.Tensor
) -> None:
    """Write ``key``/``value`` ``[kv_heads, T, head_dim]`` (strided, unit last stride, the
    cache's dtype) into ``cache`` rows ``slot_mapping`` ``[T]`` (int64, contiguous); a
    negative slot is skipped."""
    if torch.compiler.is_compiling():  # traced: the operator, whose kernel is this function
        _store_kv_op(cache, slot_mapping, key, value)
        return
    lib = kernels()
    assert lib is not None
    _same_dtype(cache, key, value)
    key, value = _unit_last(key), _unit_last(value)
    lib.stores[cache.dtype](
        key.data_ptr(),
        key.stride(1),
        key.stride(0),
        value.data_ptr(),
        value.stride(1),
        value.stride(0),
        slot_mapping.data_ptr(),
        slot_mapping.numel(),
        cache.data_ptr(),
        cache.stride(0),
        cache.stride(1),
        cache.stride(2),
        cache.stride(3),
        cache.shape[1],
        cache.shape[4],
        cache.shape[3],
    )


def decode(
    out: torch.Tensor,
    queries: torch.Tensor,
    cache: torch.Tensor,
    rows: torch.Tensor | None,
    block_table: torch.Tensor,
    contexts: torch.Tensor,
    scale: float,
) -> None:
    """Decode attention into ``out`` ``[T, heads, head_dim]`` (contiguous): decode ``i``
    reads ``queries`` ``[T, heads, head_dim]`` row ``rows[i]`` (``None``: row ``i``), attends
    to the first ``contexts[i]`` keys of its blocks ``block_table[i]`` (int32, contiguous
    rows) and writes the same row of ``out``. ``queries`` and ``out`` have the cache's
    dtype."""
    if torch.compiler.is_compiling():  # traced: the operator, whose kernel is this function
        _decode_op(out, queries, cache, rows, block_table, contexts, scale)
        return
    lib = kernels()
    assert lib is not None
    _same_dtype(cache, queries, out)
    queries = _unit_last(queries)
    lib.decodes[cache.dtype](
        queries.data_ptr(),
        queries.stride(0),
        queries.stride(1),
        None if rows is None else rows.data_ptr(),
        cache.data_ptr(),
        cache.stride(0),
        cache.stride(1),
        cache.stride(2),
        cache.stride(3),
        block_table.data_ptr(),
        block_table.stride(0),
        contexts.data_ptr(),
        contexts.numel(),
        queries.shape[1],
        cache.shape[1],
        cache.shape[4],
        cache.shape[3],
        scale,
        out.data_ptr(),
        out.stride(0),
        out.stride(1),
        torch.get_num_threads(),
    )


# The same as torch operators, for a compiled forward (``compiled.py``): torch.compile
# cannot trace a ctypes call, and would split the graph at each one. Registered as plain
# CPU kernels of the dispatcher (not ``torch.library.custom_op``, whose Python wrappers
# cost ~17 us more per call: a step calls them twice per layer). Eager calls skip the
# operator dispatch altogether; a traced call becomes the operator, which runs the same
# function (not tracing then) when the compiled forward runs.
_LIBRARY = torch.library.Library("mpengine", "DEF")


def _operator(schema: str, kernel: Callable[..., None]) -> torch._ops.OpOverload:
    name = schema.split("(", 1)[0]
    _LIBRARY.define(schema)
    _LIBRARY.impl(name, kernel, "CPU")
    torch.library.register_fake(f"mpengine::{name}", lambda *args: None, lib=_LIBRARY)
    return getattr(torch.ops.mpengine, name).default


_store_kv_op = _operator(
    "native_store_kv(Tensor(a!) cache, Tensor slot_mapping, Tensor key, Tensor value) -> ()",
    store_kv,
)
_decode_op = _operator(
    "native_decode(Tensor(a!) out, Tensor queries, Tensor cache, Tensor? rows, "
    "Tensor block_table, Tensor contexts, float scale) -> ()",
    decode,
)


def _same_dtype(cache: torch.Tensor, *tensors: torch.Tensor) -> None:
    """The kernels read raw memory as the cache's element type: anything else is garbage."""
    for tensor in tensors:
        if tensor.dtype != cache.dtype:
            raise TypeError(f"native attention: a {tensor.dtype} tensor for a {cache.dtype} cache")


def _unit_last(tensor: torch.Tensor) -> torch.Tensor:
    return tensor if tensor.stride(-1) == 1 else tensor.contiguous()

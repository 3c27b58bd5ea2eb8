"""What every benchmark in tools/ shares: the run's provenance, results written as they come,
a GPU share per engine, and one percentile.

A benchmark may run once, unattended, on a borrowed machine: ``Report`` rewrites its JSON
after every figure (``"complete": false`` until the end), and ``stop_on_sigterm`` turns the
``timeout`` command's SIGTERM into ``SystemExit``, so ``finally`` blocks stop the engines
and what was measured is kept.
"""

from __future__ import annotations

import json
import math
import os
import platform
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("mpengine", "torch", "transformers", "tokenizers", "triton", "msgspec", "pyzmq")
# On CUDA, engines of one benchmark process share the device; this much of it goes to them
# all (the rest: CUDA contexts, and a Hugging Face row in the benchmark's own process).
GPU_SHARE_TOTAL = 0.85


def stop_on_sigterm() -> None:
    """SIGTERM (``timeout``, a scheduler) raises SystemExit: ``finally`` blocks run."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


def gpu_share(device: str, num_engines: int, hf_row: bool = True) -> float | None:
    """Each engine's ``gpu_memory_utilization`` when ``num_engines`` run at once on CUDA
    (with room for a Hugging Face row); None on the CPU (or when CUDA is absent)."""
    if device == "cpu" or num_engines < 1:
        return None
    if device == "auto":
        try:
            import torch
        except ImportError:
            return None
        if not torch.cuda.is_available():
            return None
    return GPU_SHARE_TOTAL / (num_engines + (1 if hf_row else 0))


def percentile(values: Sequence[float], q: float) -> float:
    """The nearest-rank percentile (``q`` in 0..1): the smallest value with at least ``q``
    of the values at or below it; NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = max(1, math.ceil(q * len(ordered)))
    return ordered[rank - 1]


def provenance(args: Any = None) -> dict[str, Any]:
    """Where a figure comes from: the command, the commit, versions, the machine."""
    info: dict[str, Any] = {
        "argv": sys.argv,
        "args": {k: v for k, v in vars(args).items() if _plain(v)} if args is not None else {},
        "commit": _commit(),
        "python": platform.python_version(),
        "versions": {name: _version(name) for name in PACKAGES},
        "cpus": os.cpu_count(),
        "affinity": len(os.sched_getaffinity(0)),
        "gpu": _gpu(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    return info


def engine_record(engine: Any) -> dict[str, Any]:
    """What a launched engine resolved: device, dtype, KV cache, threads, and the options
    that shape a step."""
    model, config = engine.model, engine.config
    record: dict[str, Any] = {
        name: getattr(config, name)
        for name in (
            "runtime",
            "async_depth",
            "max_num_seqs",
            "max_num_batched_tokens",
            "block_size",
            "prefix_caching",
            "enforce_eager",
            "attention_backend",
            "gpu_memory_utilization",
        )
        if hasattr(config, name)
    }
    if model is not None:
        names = ("device", "dtype", "vocab_size", "max_model_len", "num_blocks", "kv_cache_bytes")
        for name in (*names, "num_threads", "thread_tuning"):
            if hasattr(model, name):
                record[name] = getattr(model, name)
    return record


class Report:
    """A benchmark's JSON, rewritten whole (atomically) each time a figure is added."""

    def __init__(self, path: str, args: Any = None, **fields: Any) -> None:
        self.path = Path(path)
        self.data: dict[str, Any] = {"complete": False, **provenance(args), **fields}
        self.save()

    def update(self, **fields: Any) -> None:
        self.data.update(fields)
        self.save()

    def append(self, key: str, item: Any) -> None:
        self.data.setdefault(key, []).append(item)
        self.save()

    def finish(self, **fields: Any) -> None:
        self.data.update(fields, complete=True, finished=time.strftime("%Y-%m-%dT%H:%M:%S%z"))
        self.save()

    def save(self) -> None:
        partial = self.path.with_name(self.path.name + ".part")
        partial.write_text(json.dumps(self.data, indent=2, default=str))
        partial.replace(self.path)


def _plain(value: Any) -> bool:
    return value is None or isinstance(value, str | int | float | bool | list | tuple | dict)


def _version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _commit() -> str | None:
    """The checkout's commit (``MPENGINE_COMMIT`` where a copy has no git metadata)."""
    return os.environ.get("MPENGINE_COMMIT") or _output(
        ["git", "-C", str(ROOT), "rev-parse", "HEAD"]
    )


def _gpu() -> str | None:
    """The GPU's name and driver, from ``nvidia-smi`` (no torch import); None without one."""
    return _output(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"])


def _output(cmd: list[str]) -> str | None:
    """What ``cmd`` prints, stripped; None when it cannot run or prints nothing."""
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None

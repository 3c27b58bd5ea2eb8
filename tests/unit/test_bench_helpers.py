"""The benchmarks' shared helpers (mpengine.testing.bench)."""

from __future__ import annotations

import json
import math
import signal
from argparse import Namespace
from pathlib import Path

import pytest

from mpengine.testing.bench import Report, gpu_share, percentile, stop_on_sigterm


def test_percentile_is_the_nearest_rank() -> None:
    values = list(range(1, 101))  # 1..100
    assert percentile(values, 0.5) == 50 and percentile(values, 0.99) == 99
    assert percentile(values, 1.0) == 100 and percentile([7.0], 0.99) == 7.0
    assert percentile(list(reversed(values)), 0.01) == 1
    assert math.isnan(percentile([], 0.5))


def test_engines_share_a_gpu_and_not_a_cpu() -> None:
    assert gpu_share("cpu", 4) is None
    assert gpu_share("cuda", 3) == pytest.approx(0.85 / 4)  # three engines and an HF row
    assert gpu_share("cuda", 2, hf_row=False) == pytest.approx(0.425)


def test_a_report_is_on_disk_after_every_figure(tmp_path: Path) -> None:
    path = tmp_path / "bench.json"
    report = Report(str(path), Namespace(rounds=3, engine={"device": "cpu"}), model="tiny")
    assert json.loads(path.read_text())["complete"] is False
    report.append("results", {"tokens_per_s": 10.0})
    data = json.loads(path.read_text())
    assert data["results"] == [{"tokens_per_s": 10.0}] and data["args"]["rounds"] == 3
    assert data["model"] == "tiny" and "versions" in data and "commit" in data
    report.finish(total=1)
    assert json.loads(path.read_text())["complete"] is True
    assert not list(tmp_path.glob("*.part"))


def test_sigterm_runs_finally_blocks() -> None:
    previous = signal.getsignal(signal.SIGTERM)
    cleaned = []
    try:
        stop_on_sigterm()
        with pytest.raises(SystemExit) as exit_info:
            try:
                signal.raise_signal(signal.SIGTERM)
            finally:
                cleaned.append(True)
        assert exit_info.value.code == 128 + signal.SIGTERM and cleaned
    finally:
        signal.signal(signal.SIGTERM, previous)

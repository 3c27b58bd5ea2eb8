"""The command line: help documents every engine flag; generate prints completions."""

from __future__ import annotations

import json
import subprocess
import sys

from mpengine.cli import build_parser
from mpengine.config import EngineConfig


def test_help_documents_every_engine_flag():
    gen = build_parser()._subparsers._group_actions[0].choices["generate"]
    text = gen.format_help()
    for name in EngineConfig.__struct_fields__:
        assert "--" + name.replace("_", "-") in text, name


def test_generate_prints_completions():
    cmd = [
        sys.executable,
        "-m",
        "mpengine.cli",
        "generate",
        "--model",
        "tiny",
        "--json",
        "--prompt",
        "Hello there",
        "--prompt",
        "The sea",
        "--max-tokens",
        "5",
        "--ignore-eos",
        "--runtime",
        "processes",
        "--log-level",
        "WARNING",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    records = [json.loads(line) for line in done.stdout.splitlines()]
    assert [r["prompt"] for r in records] == ["Hello there", "The sea"]
    assert all(len(r["token_ids"]) == 5 and r["finish_reason"] == "length" for r in records)
    assert "tokens/s" in done.stderr


def test_bad_flags_fail_clearly():
    cmd = [sys.executable, "-m", "mpengine.cli", "generate", "--temperature", "-1"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "temperature" in done.stderr
    cmd = [sys.executable, "-m", "mpengine.cli", "generate", "--async-depth", "3"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "async_depth" in done.stderr
